"""The one scheduler under every driver that takes many requests: B sequence slots over one
preallocated cache (`kvcache`), continuous batching, fed by a batch job's list or a server's inbox.

Requests are prefilled into free slots (every newly free slot in one `Slots.admit`, on those rows only;
a long prompt a chunk per decode step, so the running rows keep streaming) and decoded together by the
same `decode` loop as `run`, which here stops as soon as any row finishes: its result is handed over at
once and a waiting request takes the slot while the others keep going. Every row samples with keys from
its own seed and positions, so a result does not depend on its batch-mates, the batch size or its slot.
`continuous=False` is static batching (a new group only once every slot is free), kept to measure the
difference.

A finished row keeps its K/V: a request whose prompt begins with tokens a free row holds (the same
system prompt, a chat's earlier turns) is admitted to that row and prefills only the rest, as a chat
does within one conversation (`Slots.reusable`); where another row holds more of it (a running
request's prompt, another free row's sequence), that row's K/V is copied over first. Requests that
share a prompt's beginning and arrive together (n choices of one prompt, many clients' one system
prompt) take one prefill between them: the second waits a step for the first's.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from jaxinfer.constrain import Constraint
from jaxinfer.engine import Speculated, finish_reason, percentile
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import TextStream, logprob_entries, prompt_logprob_entries
from jaxinfer.loading import LoadedModel
from jaxinfer.processes import stop_point
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling
from jaxinfer.slots import MIN_REUSE, Admission, Decoding, Slots, penalized, reusable

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
    logit_bias: dict[int, float] | None = None  # token id → added to its logit
    tools: str | None = None  # where tools were offered, the format of the calls in the text (`jaxinfer.tools`)
    # OpenAI's echo: the prompt's text, given back in the record ("prompt"), with its tokens'
    # log-probabilities where logprobs are asked for ("prompt_logprobs": `perplexity.prompt_logprobs`)
    echo: str | None = None
    # where the text is wanted as it is made: called from the scheduler's thread with each new piece,
    # the number of tokens that made it, and (where logprobs are asked for) their entries
    on_text: Callable[[str, int, list[dict]], None] | None = None
    cancelled: bool = False  # set from any thread: the row stops at the next step, its result says "cancelled"
    arrived: float | None = None  # perf_counter when it came (None: when the run started)


class Inbox:
    """Requests arriving from other threads (a server's handlers), taken by the scheduler as slots
    free up. `close` ends the scheduler's `run` once what was put is done."""

    def __init__(self):
        self._queue: deque[Request] = deque()
        self._ready = threading.Condition()
        self.closed = False

    def put(self, request: Request) -> None:
        with self._ready:
            if self.closed:
                raise JaxinferError("the scheduler is shutting down")
            self._queue.append(request)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify()

    def __len__(self) -> int:
        return len(self._queue)

    def put_back(self, requests: list[Request]) -> None:
        """Requests taken but not admitted yet: first again, in their order."""
        with self._ready:
            self._queue.extendleft(reversed(requests))

    def take(self) -> Request | None:
        """The next request not cancelled while it waited, or None if none is waiting."""
        with self._ready:
            while self._queue:
                request = self._queue.popleft()
                if not request.cancelled:
                    return request
        return None

    @property
    def done(self) -> bool:
        return self.closed and not self._queue

    def wait(self) -> None:
        """Until a request waits or the inbox is closed."""
        with self._ready:
            self._ready.wait_for(lambda: self._queue or self.closed)


class _Listed(Inbox):
    """A batch job's requests: all there from the start, taken in order."""

    def __init__(self, requests: Iterable[Request]):
        super().__init__()
        self._queue.extend(requests)
        self.closed = True


@dataclass
class _Slot:
    request: Request
    text: TextStream
    admitted: float  # perf_counter at admission
    cached: int = 0  # prompt tokens the row already held (not prefilled)
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
    cached_tokens: int = 0  # prompt tokens taken from rows' caches instead of prefilled
    compile: CompileReport = field(default_factory=CompileReport)


class Scheduler:
    """`interval_s`: where results stream (a server), each dispatch runs as many decode steps as fit
    in about that long, so text reaches clients and new requests their slots that often; None
    (a batch job) runs CHUNK_STEPS per dispatch."""

    def __init__(
        self,
        model: LoadedModel,
        batch_size: int,
        max_context: int,
        decoding: Decoding = Decoding(),
        interval_s: float | None = None,
    ):
        self.model, self.batch_size, self.max_context = model, batch_size, max_context
        self.slots = Slots(model.config, model.params, batch_size, max_context, model.eos_ids, decoding)
        self.stats = BatchStats()
        self.interval_s = interval_s
        self.busy = 0  # rows running a request
        self._held = [np.zeros(0, np.int32)] * batch_size  # per row: the tokens whose K/V it holds, from 0

    def run(self, requests: Iterable[Request] | Inbox, on_result: Callable[[dict], None], continuous: bool = True):
        """Generate every request (those of a list, or those put in an `Inbox` until it is closed);
        `on_result(record)` is called as each one finishes."""
        inbox = requests if isinstance(requests, Inbox) else _Listed(requests)
        slots: list[_Slot | None] = [None] * self.batch_size
        started = time.perf_counter()
        steps, dispatched = CHUNK_STEPS if self.interval_s is None else 1, None
        while True:
            if continuous or not any(slots):
                self._admit(inbox, slots, wait_for_mates=continuous)
            self.busy = sum(slot is not None for slot in slots)
            if not any(slots):
                if inbox.done:
                    return
                inbox.wait()
                continue
            made = self._collect(slots, on_result, started)
            if made < 0 and len(inbox) and continuous:
                continue  # fill the freed slots before decoding on
            if any(slots):
                if self.interval_s is not None and dispatched is not None and made > 0:  # the next takes ~interval_s
                    per_token = (time.perf_counter() - dispatched) / made
                    steps = max(1, min(CHUNK_STEPS, int(self.interval_s / max(per_token, 1e-6))))
                stop_point()  # joined processes: a Ctrl-C in the first stops all here
                before = self.stats.compile.seconds
                dispatched = time.perf_counter()
                self.slots.step(steps, self.stats.compile, stop_on_finish=True)
                for slot in filter(None, slots):
                    slot.compiling_s += self.stats.compile.seconds - before

    def _admit(self, inbox: Inbox, slots: list[_Slot | None], wait_for_mates: bool = True) -> None:
        """Take a request for every free slot and prefill them in one call (grouped by
        `Slots.admit`). Each goes to the free row that holds the longest prefix of its prompt, and
        takes a longer one from any other row that holds it (a running row's prompt, a free row's
        last sequence: the same system prompt, one prompt asked for n times) by copying its K/V.
        A prompt sharing more with one admitted now or still prefilling waits for it
        (`wait_for_mates`): one prefill serves both, the second a step later."""
        free = [i for i in range(self.batch_size) if slots[i] is None]
        if not free or not len(inbox):
            return
        # Rows by their first MIN_REUSE tokens (a prefix shorter than that is not reused): those
        # whose K/V may be copied (not still prefilling), and the prompts still to be prefilled.
        prefilling = self.slots.prefilling
        holders: dict[tuple, list] = defaultdict(list)
        mates: dict[tuple, list] = defaultdict(list)
        for i, slot in enumerate(slots):
            tokens = self._held[i] if slot is None else slot.request.prompt_ids
            (mates if prefilling[i] else holders)[tuple(tokens[:MIN_REUSE])].append((i, np.asarray(tokens, np.int32)))
        admitted: list[tuple[int, int, int | None, Request]] = []
        waiting: list[Request] = []
        while free and (request := inbox.take()) is not None:
            prompt = request.prompt_ids
            n = len(prompt)
            if not 0 < n < n + request.max_tokens <= self.max_context:
                inbox.put_back(waiting)
                raise JaxinferError(
                    f"request {request.id!r}: {n} prompt tokens + max_tokens {request.max_tokens} do not fit the "
                    f"context of {self.max_context}"
                )
            held = [reusable(prompt, self._held[i]) for i in free]
            # the row holding most of the prompt; among equals, the one holding least (kept for its own)
            best = max(range(len(free)), key=lambda k: (held[k], -len(self._held[free[k]])))
            start, source = held[best], None
            key = tuple(prompt[:MIN_REUSE])
            for i, tokens in holders.get(key, ()):
                if (shared := reusable(prompt, tokens)) > start:
                    start, source = shared, i
            if wait_for_mates and any(reusable(prompt, m) > start for _, m in mates.get(key, ())):
                waiting.append(request)
                continue
            row = free.pop(best)
            admitted.append((row, start, source, request))
            mates[key].append((None, np.asarray(prompt, np.int32)))
            # not a source for later requests: a copy into it (this one's) runs before theirs out of it
            held_by_row = holders[tuple(self._held[row][:MIN_REUSE])]
            held_by_row[:] = [(i, tokens) for i, tokens in held_by_row if i != row]
        inbox.put_back(waiting)
        if not admitted:
            return
        if any(r.logprobs is not None for *_, r in admitted):
            self.slots.record_logprobs()
        if any(r.constraint is not None for *_, r in admitted):
            self.slots.constrain(self.model.tokenizer)
        if any(r.logit_bias or penalized(r.sampling) for *_, r in admitted):
            self.slots.penalize()
        for i, start, _, request in admitted:
            self._held[i] = np.asarray(request.prompt_ids[:start], np.int32)  # prefill overwrites what follows
        self.slots.admit(
            [
                Admission(
                    i,
                    r.prompt_ids,
                    r.max_tokens,
                    r.seed,
                    r.sampling,
                    start,
                    ignore_eos=r.ignore_eos,
                    speculate=r.speculate,
                    constraint=r.constraint,
                    logit_bias=r.logit_bias,
                    source=source,
                )
                for i, start, source, r in admitted
            ],
            self.stats.compile,
        )
        now = time.perf_counter()
        for i, *_, request in admitted:
            text = TextStream(self.model.tokenizer, request.prompt_ids, request.stop)
            cached = self.slots.admitted(i).start  # none where longrope's factors changed
            slots[i] = _Slot(request, text, now, cached, read=len(request.prompt_ids))
            self.stats.cached_tokens += cached

    def _collect(self, slots: list[_Slot | None], on_result, started: float) -> int:
        """Pass new tokens to each live slot's text; hand over and free the finished ones. Returns
        the most tokens a row made since the last call, or -1 if a row was freed."""
        tokens, length, done = self.slots.fetch()
        prefilling = self.slots.prefilling
        asked = any(slot and slot.request.logprobs is not None for slot in slots)
        lp = self.slots.fetch_logprobs() if asked else None
        now = time.perf_counter()
        finished = np.zeros(len(slots), bool)
        most = 0
        for i, slot in enumerate(slots):
            if slot is None or prefilling[i]:  # a long prompt between chunks: no token yet
                continue
            request = slot.request
            made = int(length[i]) - slot.read
            most = max(most, made)
            if slot.first_token is None:
                slot.first_token = now
            elif made:  # the wait since the row's last tokens, admissions of others included, spread over the new ones
                slot.itl_s += [(now - slot.last_token - slot.compiling_s) / made] * made
                slot.compiled_s += slot.compiling_s
            if made:
                slot.last_token, slot.compiling_s = now, 0.0
            pieces, first = [], len(slot.text.token_ids)
            for position in range(slot.read, int(length[i])):
                pieces.append(slot.text.push(int(tokens[i, position])))
                if request.logprobs is not None:
                    slot.logprobs.append(lp.at(i, position))
                if slot.text.stopped:
                    break
            self.stats.generated_tokens += made
            slot.read = int(length[i])
            if request.on_text and pieces:
                request.on_text("".join(pieces), len(pieces), self._entries(slot, first))
            if done[i] or slot.text.stopped or request.cancelled:
                finished[i] = True
                self.stats.finished += 1
                eos = bool(done[i]) and not request.ignore_eos and int(tokens[i, length[i] - 1]) in self.model.eos_ids
                c = self.slots.counters
                spec = Speculated(
                    int(c.drafted[i]),
                    int(c.accepted[i]),
                    int(c.passes[i]),
                    int(length[i]) - len(request.prompt_ids) - 1,
                )
                unfinished = request.constraint is not None and not self.slots.matchers.complete(i)
                on_result(self._record(slot, eos, unfinished, now, started, spec if request.speculate else None))
                slots[i] = None
                self._held[i] = tokens[i, : int(length[i]) - self.slots.speculation.uncached].copy()
        if finished.any():
            self.slots.retire(finished)  # a stop string: the row stops now
        return -1 if finished.any() else most

    def _entries(self, slot: _Slot, first: int) -> list[dict]:
        """The logprob entries of the slot's tokens from `first` on, where its request asks."""
        if slot.request.logprobs is None:
            return []
        tokens = slot.text.token_ids[first:]
        return logprob_entries(self.model.tokenizer, tokens, slot.logprobs[first:], slot.request.logprobs)

    def _record(
        self, slot: _Slot, eos: bool, unfinished: bool, now: float, started: float, speculated: Speculated | None
    ) -> dict:
        text, request = slot.text, slot.request
        text.flush()
        generated = len(text.token_ids)
        arrived = started if request.arrived is None else request.arrived
        decode_s = now - slot.first_token - slot.compiled_s
        itl_ms = [1000 * s for s in slot.itl_s] or [0.0]
        return (
            {
                "id": request.id,
                "text": text.text,
                "prompt_tokens": len(request.prompt_ids),
                "generated_tokens": generated,
                "cached_tokens": slot.cached,
                "finish_reason": "cancelled"
                if request.cancelled
                else "stop"
                if text.stopped
                else finish_reason(eos, generated >= request.max_tokens, unfinished),
                "seed": request.seed,
                "timings": {
                    "queued_s": round(slot.admitted - arrived, 4),
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
            }
            | (
                {"logprobs": logprob_entries(self.model.tokenizer, text.token_ids, slot.logprobs, request.logprobs)}
                if request.logprobs is not None
                else {}
            )
            | (self._echoed(request) if request.echo is not None else {})
        )

    def _echoed(self, request: Request) -> dict:
        """The record's echo: the prompt, and its tokens' log-probabilities where they are asked for
        (one pass over the prompt, here on the scheduler's thread between dispatches)."""
        if request.logprobs is None:
            return {"prompt": request.echo}
        entries = prompt_logprob_entries(self.model, request.prompt_ids, request.logprobs)
        return {"prompt": request.echo, "prompt_logprobs": entries}
