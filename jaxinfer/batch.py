"""Continuous batching: B sequence slots over one preallocated cache (`kvcache`).

Requests are prefilled into free slots (every newly free slot in one `Slots.admit`, on those rows only;
a long prompt a chunk per decode step, so the running rows keep streaming) and decoded together by the
same `decode` loop as `run`, which here stops as soon as any row finishes: its result is handed over at
once and a waiting request takes the slot while the others keep going. Every row samples with keys from
its own seed and positions, so a result does not depend on its batch-mates, the batch size or its slot.
`continuous=False` is static batching (a new group only once every slot is free), kept to measure the
difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from jaxinfer.constrain import Constraint
from jaxinfer.engine import Speculated, finish_reason, percentile
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import TextStream, logprob_entries
from jaxinfer.loading import LoadedModel
from jaxinfer.processes import stop_point
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling
from jaxinfer.slots import Admission, Decoding, Slots

CHUNK_STEPS = 64  # decode steps per dispatch at most: bounds how late stop strings and Ctrl-C are seen


@dataclass
class Request:
    id: object
    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    seed: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculate: bool = False  # draft (where the runner speculates)
    logprobs: int | None = None  # alternatives per token beside its own log-probability (None: none given)
    constraint: Constraint | None = None  # what the output must match (`jaxinfer.constrain`)


@dataclass
class _Slot:
    request: Request
    text: TextStream
    admitted: float  # perf_counter at admission
    first_token: float | None = None
    last_token: float = 0.0  # perf_counter when the row's latest tokens reached the host
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    compiling_s: float = 0.0  # compile time (a new kv bucket) since the row's latest tokens: not its latency
    compiled_s: float = 0.0  # all compile time after its first token
    read: int = 0  # tokens of the row already passed to `text`
    logprobs: list = field(default_factory=list)  # where asked for: the row's tokens' (`TokenStream.logprobs`)


@dataclass
class BatchStats:
    generated_tokens: int = 0
    finished: int = 0
    compile: CompileReport = field(default_factory=CompileReport)


class BatchRunner:
    def __init__(
        self,
        model: LoadedModel,
        batch_size: int,
        max_context: int,
        decoding: Decoding = Decoding(),
    ):
        self.model, self.batch_size, self.max_context = model, batch_size, max_context
        self.slots = Slots(model.config, model.params, batch_size, max_context, model.eos_ids, decoding)
        self.stats = BatchStats()

    def run(self, requests: Iterable[Request], on_result: Callable[[dict], None], continuous: bool = True) -> None:
        """Generate every request; `on_result(record)` is called as each one finishes."""
        pending = iter(requests)
        slots: list[_Slot | None] = [None] * self.batch_size
        exhausted = False
        started = time.perf_counter()
        while True:
            if continuous or not any(slots):
                admitted = []
                for i in range(self.batch_size):
                    if slots[i] is None and not exhausted:
                        request = next(pending, None)
                        exhausted = request is None
                        if request is not None:
                            admitted.append((i, request))
                self._admit(admitted, slots)
            if not any(slots):
                return
            freed = self._collect(slots, on_result, started)
            if freed and not exhausted and continuous:
                continue  # fill the freed slots before decoding on
            if any(slots):
                stop_point()  # joined processes: a Ctrl-C in the first stops all here
                before = self.stats.compile.seconds
                self.slots.step(CHUNK_STEPS, self.stats.compile, stop_on_finish=True)
                for slot in filter(None, slots):
                    slot.compiling_s += self.stats.compile.seconds - before

    def _admit(self, admitted: list[tuple[int, Request]], slots: list[_Slot | None]) -> None:
        """Prefill every newly filled slot in one call (grouped by `Slots.admit`)."""
        for _, request in admitted:
            n = len(request.prompt_ids)
            if not 0 < n < n + request.max_tokens <= self.max_context:
                raise JaxinferError(
                    f"request {request.id!r}: {n} prompt tokens + max_tokens {request.max_tokens} do not fit the "
                    f"context of {self.max_context}"
                )
        if not admitted:
            return
        if any(r.logprobs is not None for _, r in admitted):
            self.slots.record_logprobs()
        if any(r.constraint is not None for _, r in admitted):
            self.slots.constrain(self.model.tokenizer)
        self.slots.admit(
            [
                Admission(
                    i,
                    r.prompt_ids,
                    r.max_tokens,
                    r.seed,
                    r.sampling,
                    ignore_eos=r.ignore_eos,
                    speculate=r.speculate,
                    constraint=r.constraint,
                )
                for i, r in admitted
            ],
            self.stats.compile,
        )
        now = time.perf_counter()
        for i, request in admitted:
            text = TextStream(self.model.tokenizer, request.prompt_ids, request.stop)
            slots[i] = _Slot(request, text, now, read=len(request.prompt_ids))

    def _collect(self, slots: list[_Slot | None], on_result, started: float) -> bool:
        """Pass new tokens to each live slot's text; hand over and free the finished ones."""
        tokens, length, done = self.slots.fetch()
        prefilling = self.slots.prefilling
        asked = any(slot and slot.request.logprobs is not None for slot in slots)
        lp = self.slots.fetch_logprobs() if asked else None
        now = time.perf_counter()
        finished = np.zeros(len(slots), bool)
        for i, slot in enumerate(slots):
            if slot is None or prefilling[i]:  # a long prompt between chunks: no token yet
                continue
            made = int(length[i]) - slot.read
            if slot.first_token is None:
                slot.first_token = now
            elif made:  # the wait since the row's last tokens, admissions of others included, spread over the new ones
                slot.itl_s += [(now - slot.last_token - slot.compiling_s) / made] * made
                slot.compiled_s += slot.compiling_s
            if made:
                slot.last_token, slot.compiling_s = now, 0.0
            for position in range(slot.read, int(length[i])):
                slot.text.push(int(tokens[i, position]))
                if slot.request.logprobs is not None:
                    slot.logprobs.append(lp.at(i, position))
                if slot.text.stopped:
                    break
            self.stats.generated_tokens += made
            slot.read = int(length[i])
            if done[i] or slot.text.stopped:
                finished[i] = True
                self.stats.finished += 1
                eos = (
                    bool(done[i])
                    and not slot.request.ignore_eos
                    and int(tokens[i, length[i] - 1]) in self.model.eos_ids
                )
                c = self.slots.counters
                spec = Speculated(
                    int(c.drafted[i]),
                    int(c.accepted[i]),
                    int(c.passes[i]),
                    int(length[i]) - len(slot.request.prompt_ids) - 1,
                )
                unfinished = slot.request.constraint is not None and not self.slots.matchers.complete(i)
                on_result(self._record(slot, eos, unfinished, now, started, spec if slot.request.speculate else None))
                slots[i] = None
        if finished.any():
            self.slots.retire(finished)  # a stop string: the row stops now
        return bool(finished.any())

    def _record(
        self, slot: _Slot, eos: bool, unfinished: bool, now: float, started: float, speculated: Speculated | None
    ) -> dict:
        text = slot.text
        text.flush()
        generated = len(text.token_ids)
        decode_s = now - slot.first_token - slot.compiled_s
        itl_ms = [1000 * s for s in slot.itl_s] or [0.0]
        return {
            "id": slot.request.id,
            "text": text.text,
            "prompt_tokens": len(slot.request.prompt_ids),
            "generated_tokens": generated,
            "finish_reason": "stop"
            if text.stopped
            else finish_reason(eos, generated >= slot.request.max_tokens, unfinished),
            "seed": slot.request.seed,
            "timings": {
                "queued_s": round(slot.admitted - started, 4),
                "ttft_s": round(slot.first_token - slot.admitted, 4),
                "total_s": round(now - slot.admitted, 4),
                "decode_tok_s": round((generated - 1) / decode_s, 2) if decode_s > 0 and generated > 1 else 0.0,
                "itl_ms": {
                    "p50": round(percentile(itl_ms, 0.5), 3),
                    "p99": round(percentile(itl_ms, 0.99), 3),
                    "max": round(max(itl_ms), 3),
                },
            }
            | ({"speculation": speculated.as_dict()} if speculated else {}),
        } | (
            {"logprobs": logprob_entries(self.model.tokenizer, text.token_ids, slot.logprobs, slot.request.logprobs)}
            if slot.request.logprobs is not None
            else {}
        )
