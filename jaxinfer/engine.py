"""The host side of generating one sequence (run, chat): drives the two compiled phases through
one row of `jaxinfer.slots.Slots`, keeps what the cache holds between requests, times both phases.

Streaming is done by running the decode `while_loop` in chunks: each dispatch runs as many steps as
fit in about `STREAM_INTERVAL_S` (measured on the previous chunk, passed as a traced value, so it never
recompiles), then the new tokens come back to the host. This keeps host round-trips out of the loop
body, puts tokens on screen within a fraction of a second, and lets Ctrl-C land between chunks
(a running `while_loop` cannot be interrupted). scripts/bench_streaming.py measures its cost
against one whole-request loop.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.constrain import Constraint
from jaxinfer.processes import agree, shared_seed, stop_point
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling, check_logit_bias
from jaxinfer.slots import Admission, Decoding, Slots, check_fits, penalized, reusable

STREAM_INTERVAL_S = 0.05


def finish_reason(eos: bool, budget_spent: bool, unfinished: bool) -> str:
    """Why a row ended: "eos", "length" (its budget), "unfinished" (a constrained row whose budget
    ran out, or that could go no further, before its match was whole), else "stop" (a constraint's
    match, complete)."""
    if unfinished:
        return "unfinished"
    return "eos" if eos else "length" if budget_spent else "stop"


def percentile(values: list[float], q: float) -> float:
    """The value at rank ⌊q·n⌋ of the sorted values (the largest for q near 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Speculated:
    """What speculation did for a generation: draft tokens verified, of them kept, decode passes."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    decoded: int = 0  # tokens the passes made

    def as_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "tokens_per_step": round(self.decoded / self.passes, 4) if self.passes else 0.0,
        }


@dataclass
class Timings:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the KV cache from an earlier request: not prefilled
    generated_tokens: int = 0
    ttft_s: float = 0.0  # prefill dispatch → first token on the host, compile excluded
    decode_s: float = 0.0  # wall time of the decode loop after the first token, compile excluded
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    kv_read: int = 0  # cache positions the decode steps attended over, summed over steps (the kv buckets)
    compile: CompileReport = field(default_factory=CompileReport)
    speculation: Speculated | None = None  # where the decode loop speculated

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefilled_tokens / self.ttft_s if self.ttft_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s else 0.0

    def itl_ms(self) -> dict[str, float]:
        if not self.itl_s:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
        ms = [1000 * s for s in self.itl_s]
        return {"mean": statistics.fmean(ms), "p50": percentile(ms, 0.5), "p90": percentile(ms, 0.9)}

    def as_dict(self) -> dict:
        spec = {"speculation": self.speculation.as_dict()} if self.speculation else {}
        return spec | {
            "prefilled_tokens": self.prefilled_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "itl_ms": {k: round(v, 4) for k, v in self.itl_ms().items()},
            "compile_s": round(self.compile.seconds, 4),
            "compile_cache": self.compile.cache,
        }


@dataclass
class TokenStream:
    """Iterate to get the new token ids chunk by chunk; stopping early is just not iterating on.
    Once it is exhausted, `finish_reason` is 'eos' or 'length' and `timings` is complete."""

    seed: int
    timings: Timings
    finish_reason: str | None = None
    chunks: Iterator[list[int]] = iter(())
    # where asked for: each new token's log-probabilities as they came (chosen, ids [N], top [N])
    logprobs: list[tuple[float, np.ndarray, np.ndarray]] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        return self.chunks


def compile_ahead(opened, prompt: list[int], max_tokens: int) -> None:
    """The programs `Engine.generate` starts `prompt` with (its prefill, the decode of its first kv
    bucket) compiled for an `loading.OpenModel` whose weights are abstract: `open_model`'s `ahead`,
    while the real ones load. JAX keeps what it compiled, and the real call finds it built. Plain
    requests: logprobs, constraints and penalties give the state another shape, and their programs
    with it. It pays where loading leaves the host's cores free (an accelerator's copies); on a
    2-core CPU a 1.1B model's load and compile slowed each other to more than their sum."""
    model = opened.model
    slots = Slots(model.config, model.params, 1, opened.context, model.eos_ids, opened.decoding)
    report = CompileReport()
    slots.admit([Admission(0, prompt, max_tokens, 0, Sampling(), speculate=slots.speculation.draft > 0)], report)
    slots.step(1, report)


class Engine:
    """One model, one fixed-shape cache of `max_context` positions, batch 1.

    The cache outlives a request: a prompt that starts with tokens the cache already holds (a chat's
    earlier turns, or the same prompt again) prefills only the rest.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        max_context: int,
        eos_ids: tuple[int, ...],
        decoding: Decoding = Decoding(),
    ):
        self.cfg, self.params, self.max_context, self.eos_ids = cfg, params, max_context, eos_ids
        self.slots = Slots(cfg, params, 1, max_context, eos_ids, decoding)
        self._cached = np.zeros(0, np.int32)  # tokens whose K/V the cache holds, from position 0

    def reset(self) -> None:
        """An empty cache: nothing of earlier requests is reused."""
        self.slots.reset()
        self._cached = self._cached[:0]

    def cached_prefix(self, prompt: list[int]) -> int:
        """How many leading prompt tokens to take from the cache instead of prefilling them (`reusable`)."""
        return reusable(prompt, self._cached)

    def generate(
        self,
        prompt: list[int],
        sampling: Sampling,
        max_tokens: int,
        seed: int | None = None,
        stream: bool = True,
        ignore_eos: bool = False,
        logprobs: bool = False,
        constraint: Constraint | None = None,
        tokenizer=None,
        logit_bias: dict[int, float] | None = None,
    ) -> TokenStream:
        """Start generating after `prompt`. `stream=False` runs the whole decode as one loop (one
        call per kv bucket the sequence passes through). With `logprobs`, the stream's `logprobs`
        gather each token's (`sampling.logprobs`); the first such request compiles its programs again.
        A `constraint` (`jaxinfer.constrain`, with the model's `tokenizer`) makes the output match it;
        the stream's finish reason is then "stop" where the match ended it, "unfinished" where the
        budget ran out inside it. `logit_bias`: token id → added to its logit at every step."""
        check_fits(len(prompt), max_tokens, self.max_context)
        check_logit_bias(logit_bias, self.cfg.sampled_ids)
        seed = shared_seed() if seed is None else seed
        result = TokenStream(seed=seed, timings=Timings(prompt_tokens=len(prompt)), logprobs=[] if logprobs else None)
        if logprobs:
            self.slots.record_logprobs()
        if constraint is not None:
            self.slots.constrain(tokenizer)
        if penalized(sampling) or logit_bias:
            self.slots.penalize()
        result.chunks = self._run(prompt, sampling, max_tokens, stream, ignore_eos, constraint, logit_bias, result)
        return result

    def _run(
        self, prompt, sampling, max_tokens, stream, ignore_eos, constraint, logit_bias, result: TokenStream
    ) -> Iterator[list[int]]:
        timings, slots = result.timings, self.slots
        if slots.lost:  # a previous call was interrupted while it held the state
            self.reset()
        n = len(prompt)
        start = timings.cached_tokens = self.cached_prefix(prompt)
        self._cached = self._cached[:start]  # prefill overwrites what follows
        admit = Admission(
            0,
            prompt,
            max_tokens,
            result.seed,
            sampling,
            start,
            ignore_eos,
            speculate=slots.speculation.draft > 0,
            constraint=constraint,
            logit_bias=logit_bias,
        )
        compiling = timings.compile.seconds
        started = time.perf_counter()
        slots.admit([admit], timings.compile)
        timings.cached_tokens = slots.admitted(0).start  # none where longrope's factors changed
        tokens, length, done = self._fetch()
        timings.ttft_s = time.perf_counter() - started - (timings.compile.seconds - compiling)
        timings.generated_tokens = 1
        self._gather_logprobs(result, n, length)
        yield [int(tokens[n])]

        steps = 1 if stream else max_tokens
        passes_before = 0  # the row's decode passes so far (counters start at its admission)
        if slots.speculation.draft:
            timings.speculation = Speculated()
        while not done:
            stop_point()  # joined processes: a Ctrl-C in the first stops all here
            compiling = timings.compile.seconds
            started = time.perf_counter()
            ran = slots.step(steps, timings.compile)
            tokens, new_length, done = self._fetch()
            # a new kv bucket compiles here
            elapsed = time.perf_counter() - started - (timings.compile.seconds - compiling)
            made = new_length - length
            passes = int(slots.counters.passes[0]) - passes_before
            passes_before += passes
            timings.decode_s += elapsed
            timings.itl_s += [elapsed / made] * made
            timings.kv_read += passes * ran.kv_len
            timings.generated_tokens += made
            if timings.speculation:
                c = slots.counters
                timings.speculation = Speculated(
                    int(c.drafted[0]), int(c.accepted[0]), int(c.passes[0]), timings.generated_tokens - 1
                )
            if stream:  # size the next chunk to take about STREAM_INTERVAL_S
                # processes run in step
                steps = agree(max(1, min(1024, int(STREAM_INTERVAL_S * made / max(elapsed, 1e-6)))))
            self._gather_logprobs(result, length, new_length)
            yield [int(t) for t in tokens[length:new_length]]
            length = new_length
        result.finish_reason = finish_reason(
            int(tokens[length - 1]) in self.eos_ids and not ignore_eos,
            length - n >= max_tokens,
            constraint is not None and not slots.matchers.complete(0),
        )

    def _gather_logprobs(self, result: TokenStream, start: int, end: int) -> None:
        """The log-probabilities of row 0's tokens at positions start:end, where the stream asks."""
        if result.logprobs is not None and end > start:
            lp = self.slots.fetch_logprobs()
            result.logprobs += [lp.at(0, p) for p in range(start, end)]

    def _fetch(self) -> tuple[np.ndarray, int, bool]:
        """Row 0's tokens, length and done flag. Also records what the caches now hold: K/V of
        every token but the last (`Speculation.uncached`)."""
        tokens, length, done = self.slots.fetch()
        self._cached = tokens[0, : int(length[0]) - self.slots.speculation.uncached].copy()
        return tokens[0], int(length[0]), bool(done[0])
