"""Continuous batching: B sequence slots over one preallocated cache [L, B, S, KV, hd].

Requests are prefilled into free slots (`prefill` on those rows only) and decoded together by the
same `decode` loop as `run`, which here stops as soon as any row finishes: its result is handed over
at once and a waiting request takes the slot while the others keep going. Every row samples with
keys from its own seed and positions, so a result does not depend on its batch-mates, the batch
size or its slot. `continuous=False` is static batching (a new group only once every slot is free),
kept to measure the difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import jax
import numpy as np

from jaxinfer.decode import admission, decode, initial_state, prefill, retire
from jaxinfer.engine import prompt_bucket
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import TextStream
from jaxinfer.loading import LoadedModel
from jaxinfer.runtime import CompileReport, Programs
from jaxinfer.sampling import Sampling

CHUNK_STEPS = 64  # decode steps per dispatch at most: bounds how late stop strings and Ctrl-C are seen


@dataclass
class Request:
    id: object
    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    seed: int
    stop: tuple[str, ...] = ()


@dataclass
class _Slot:
    request: Request
    text: TextStream
    admitted: float  # perf_counter at admission
    first_token: float | None = None
    read: int = 0  # tokens of the row already passed to `text`


@dataclass
class BatchStats:
    generated_tokens: int = 0
    finished: int = 0
    compile: CompileReport = field(default_factory=CompileReport)


class BatchRunner:
    def __init__(self, model: LoadedModel, batch_size: int, max_context: int):
        self.model, self.batch_size, self.max_context = model, batch_size, max_context
        cfg, params = model.config, model.params
        self._state = initial_state(cfg, params, batch_size, max_context, model.eos_ids)
        self._programs = Programs()
        self.stats = BatchStats()
        self._decode_args = jax.device_put((np.int32(CHUNK_STEPS), np.bool_(True)))  # steps, stop on any finish
        # compiled before any clock runs, so per-request timings never include it
        self._run_decode = self._programs.get(("decode",), self.stats.compile, decode, params, self._state, *self._decode_args, cfg=cfg)

    def run(self, requests: Iterable[Request], on_result: Callable[[dict], None], continuous: bool = True) -> None:
        """Generate every request; `on_result(record)` is called as each one finishes."""
        pending = iter(requests)
        slots: list[_Slot | None] = [None] * self.batch_size
        exhausted = False
        started = time.perf_counter()
        while True:
            if continuous or not any(slots):
                for i in range(self.batch_size):
                    if slots[i] is None and not exhausted:
                        request = next(pending, None)
                        exhausted = request is None
                        if request is not None:
                            slots[i] = self._admit(i, request)
            if not any(slots):
                return
            freed = self._collect(slots, on_result, started)
            if freed and not exhausted and continuous:
                continue  # fill the freed slots before decoding on
            if any(slots):
                self._decode()

    def _admit(self, row: int, request: Request) -> _Slot:
        n = len(request.prompt_ids)
        if not 0 < n < n + request.max_tokens <= self.max_context:
            raise JaxinferError(f"request {request.id!r}: {n} prompt tokens + max_tokens {request.max_tokens} do not fit the context of {self.max_context}")
        bucket = prompt_bucket(n, self.max_context)
        args = admission([row], [request.prompt_ids], [0], [n + request.max_tokens], [request.seed], [request.sampling], bucket)
        cfg, params = self.model.config, self.model.params
        run_prefill = self._programs.get(("prefill", bucket), self.stats.compile, prefill, params, self._state, *args, cfg=cfg, kv_len=bucket)
        self._state = run_prefill(params, self._state, *args)
        return _Slot(request, TextStream(self.model.tokenizer, request.prompt_ids, request.stop), time.perf_counter(), read=n)

    def _decode(self) -> None:
        self._state = self._run_decode(self.model.params, self._state, *self._decode_args)

    def _collect(self, slots: list[_Slot | None], on_result, started: float) -> bool:
        """Pass new tokens to each live slot's text; hand over and free the finished ones."""
        tokens, length, done = jax.device_get((self._state.tokens, self._state.length, self._state.done))
        now = time.perf_counter()
        finished = np.zeros(len(slots), bool)
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            slot.first_token = slot.first_token or now
            for token in tokens[i, slot.read : length[i]]:
                slot.text.push(int(token))
                if slot.text.stopped:
                    break
            self.stats.generated_tokens += int(length[i]) - slot.read
            slot.read = int(length[i])
            if done[i] or slot.text.stopped:
                finished[i] = True
                self.stats.finished += 1
                on_result(self._record(slot, bool(done[i]) and int(tokens[i, length[i] - 1]) in self.model.eos_ids, now, started))
                slots[i] = None
        if finished.any():
            self._state = retire(self._state, jax.device_put(finished))  # a stop string: the row stops now
        return bool(finished.any())

    @staticmethod
    def _record(slot: _Slot, eos: bool, now: float, started: float) -> dict:
        text = slot.text
        text.flush()
        generated = len(text.token_ids)
        decode_s = now - slot.first_token
        return {
            "id": slot.request.id,
            "text": text.text,
            "prompt_tokens": len(slot.request.prompt_ids),
            "generated_tokens": generated,
            "finish_reason": "stop" if text.stopped else "eos" if eos else "length",
            "seed": slot.request.seed,
            "timings": {
                "queued_s": round(slot.admitted - started, 4),
                "ttft_s": round(slot.first_token - slot.admitted, 4),
                "total_s": round(now - slot.admitted, 4),
                "decode_tok_s": round((generated - 1) / decode_s, 2) if decode_s > 0 and generated > 1 else 0.0,
            },
        }
