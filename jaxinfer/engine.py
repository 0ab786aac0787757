"""Run and chat: one sequence at a time, a B = 1 client of the `Scheduler` (the loop batch and serve
turn too) whose row keeps what the cache holds between requests; token ids out, timed by phase.

Streaming is done by running the decode `while_loop` in chunks: each dispatch runs as many steps as
fit in about `STREAM_INTERVAL_S` (measured on the previous chunk, passed as a traced value, so it never
recompiles), then the new tokens come back to the host. This keeps host round-trips out of the loop
body, puts tokens on screen within a fraction of a second, and lets Ctrl-C land between chunks
(a running `while_loop` cannot be interrupted). The next chunk is dispatched before the tokens are
handed over, so the device decodes while the host prints. scripts/bench_streaming.py measures its
cost against one whole-request loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from jaxinfer.buckets import check_fits
from jaxinfer.config import ModelConfig
from jaxinfer.constrain import Constraint
from jaxinfer.processes import shared_seed
from jaxinfer.replies import Thinking
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling, check_logit_bias
from jaxinfer.scheduler import Inbox, Request, Scheduler
from jaxinfer.slots import Admission, Decoding, Slots
from jaxinfer.timings import Timings

STREAM_INTERVAL_S = 0.05
STREAM_MAX_STEPS = 1024  # a streamed chunk's most decode steps


@dataclass
class TokenStream:
    """Iterate to get the new token ids chunk by chunk; stopping early is just not iterating on
    (the row is stopped at the engine's next request, "cancelled"). Once it is exhausted,
    `finish_reason` says why (`scheduler.finish_reason`) and `timings` is complete."""

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


@dataclass(frozen=True)
class _Weights:
    """What the scheduler reads of a model, for weights without their tokenizer: an Engine's client
    reads token ids (`Generation` makes the text)."""

    config: ModelConfig
    params: dict
    eos_ids: tuple[int, ...]
    tokenizer: None = None


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
        self.cfg, self.max_context = cfg, max_context
        self.scheduler = Scheduler(_Weights(cfg, params, eos_ids), 1, max_context, decoding)

    @property
    def slots(self) -> Slots:
        return self.scheduler.slots

    def reset(self) -> None:
        """An empty cache: nothing of earlier requests is reused."""
        self.scheduler.reset()

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
        thinking: Thinking | None = None,
    ) -> TokenStream:
        """Start generating after `prompt`. `stream=False` runs the whole decode as one loop (one
        call per kv bucket the sequence passes through). With `logprobs`, the stream's `logprobs`
        gather each token's (`sampling.logprobs`); the first such request compiles its programs again.
        A `constraint` (`jaxinfer.constrain`, with the model's `tokenizer`) makes the output match it;
        the stream's finish reason is then "stop" where the match ended it, "unfinished" where the
        budget ran out inside it. `logit_bias`: token id → added to its logit at every step.
        `thinking`: a thinking block's budget (`replies.bounded`)."""
        check_fits(len(prompt), max_tokens, self.max_context)
        check_logit_bias(logit_bias, self.cfg.sampled_ids)
        seed = shared_seed() if seed is None else seed
        result = TokenStream(seed=seed, timings=Timings(prompt_tokens=len(prompt)), logprobs=[] if logprobs else None)
        if constraint is not None:
            self.slots.constrain(tokenizer)  # here: the scheduler's model has no tokenizer
        request = Request(
            0,
            prompt,
            sampling,
            max_tokens,
            seed,
            ignore_eos=ignore_eos,
            speculate=self.slots.speculation.draft > 0,
            logprobs=0 if logprobs else None,
            constraint=constraint,
            logit_bias=logit_bias,
            thinking=thinking,
            timings=result.timings,
        )
        result.chunks = self._run(request, result, stream)
        return result

    def _run(self, request: Request, result: TokenStream, stream: bool) -> Iterator[list[int]]:
        scheduler, made = self.scheduler, []

        def on_tokens(tokens: list[int], logprobs: list, reason: str | None) -> None:
            made.extend(tokens)
            if result.logprobs is not None:
                result.logprobs.extend(logprobs)
            result.finish_reason = reason

        request.on_tokens = on_tokens
        if scheduler.slots.lost:  # a previous call was interrupted while it held the state
            scheduler.reset()
        inbox = Inbox()
        if scheduler.busy:  # a stream not read to its end (a stop string, Ctrl-C): its row stops, its K/V stays
            scheduler.rows[0].request.cancelled = True
            scheduler.turn(inbox)
        scheduler.pace(STREAM_INTERVAL_S if stream else None, STREAM_MAX_STEPS if stream else request.max_tokens)
        inbox.put(request)
        while result.finish_reason is None:
            try:
                scheduler.turn(inbox)
            except KeyboardInterrupt:  # tokens collected before it (a compile holds it) still reach the reader
                if made:
                    yield made[:]
                raise
            if made:
                chunk, made[:] = made[:], []
                yield chunk
