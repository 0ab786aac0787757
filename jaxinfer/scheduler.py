"""The one scheduler under every driver: B sequence slots over one preallocated cache (`kvcache`),
continuous batching, fed by a batch job's list, a server's inbox, or (B = 1) `Engine`'s requests for
run and chat. Each driver turns the same loop (`Scheduler.turn`: admit, collect, dispatch); batch
and serve read text and records, `Engine` token ids (`Request.on_tokens`).

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

A hybrid's recurrent state cannot be cut back, so its row is reused only where a state was kept:
after all it holds, after its last prompt, or at its mark. A prompt that shares a longer beginning
with another than it can take (a row's tokens, a prompt admitted with it or waiting: many clients'
one system prompt) marks the place they part, and its row keeps its state there as its prefill
passes it; prompts that the mark would serve wait a step for it, and every later one takes the
prefix from that row, running or free. (vLLM keeps a hybrid's states on its block grid of 500-odd
tokens, and with `--enable-mamba-shared-prefix-checkpoint` one at such a junction as well.)
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from jaxinfer import embeddings
from jaxinfer.buckets import MIN_REUSE, common_prefix, reusable
from jaxinfer.constrain import Constraint
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.processes import agree, stop_point
from jaxinfer.replies import Reading, Thinking
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling
from jaxinfer.slots import Admission, Decoding, Slots, penalized
from jaxinfer.text import TextStream, logprob_entries, prompt_logprob_entries
from jaxinfer.timings import Speculated, Timings, percentile

CHUNK_STEPS = 64  # decode steps per dispatch at most: bounds how late stop strings and Ctrl-C are seen


def finish_reason(eos: bool, budget_spent: bool, unfinished: bool) -> str:
    """Why a row ended: "eos", "length" (its budget), "unfinished" (a constrained row whose budget
    ran out, or that could go no further, before its match was whole), else "stop" (a constraint's
    match, complete)."""
    if unfinished:
        return "unfinished"
    return "eos" if eos else "length" if budget_spent else "stop"


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
    min_tokens: int = 0  # no EOS id before this many tokens (vLLM's)
    thinking: Thinking | None = None  # a thinking block's budget (`replies.bounded`)
    reading: Reading | None = None  # how a chat reply reads: reasoning, content, tool calls (`jaxinfer.replies`)
    # OpenAI's echo: the prompt's text, given back in the record ("prompt"), with its tokens'
    # log-probabilities where logprobs are asked for ("prompt_logprobs": `perplexity.prompt_logprobs`)
    echo: str | None = None
    # where the text is wanted as it is made: called from the scheduler's thread with each new piece,
    # the number of tokens that made it, and (where logprobs are asked for) their entries
    on_text: Callable[[str, int, list[dict]], None] | None = None
    # a client of token ids (`Engine`), instead of text and a record: called from the scheduler's
    # thread with each of the row's new token ids, their log-probabilities where asked for
    # ((chosen, ids [N], top [N]) each), and with the last of them its finish reason (None before)
    on_tokens: Callable[[list[int], list, str | None], None] | None = None
    cancelled: bool = False  # set from any thread: the row stops at the next step, its result says "cancelled"
    arrived: float | None = None  # perf_counter when it came (None: when the run started)
    timings: Timings | None = None  # where the client holds it: the row's, kept current as it runs


class Inbox:
    """Requests arriving from other threads (a server's handlers), taken by the scheduler as slots
    free up, and texts to embed. `close` ends the scheduler's `run` once what was put is done."""

    def __init__(self):
        self._queue: deque[Request] = deque()
        self._embeddings: deque[embeddings.Job] = deque()
        self._ready = threading.Condition()
        self.closed = False
        self.on_dropped: Callable[[Request], None] | None = None

    def put(self, request: Request | embeddings.Job) -> None:
        with self._ready:
            if self.closed:
                raise JaxinferError("the scheduler is shutting down")
            (self._embeddings if isinstance(request, embeddings.Job) else self._queue).append(request)
            self._ready.notify()

    def take_embeddings(self) -> list[embeddings.Job]:
        with self._ready:
            taken, self._embeddings = list(self._embeddings), deque()
        return taken

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def texts_waiting(self) -> int:
        """Embedding jobs put and not taken yet."""
        return len(self._embeddings)

    def put_back(self, requests: list[Request]) -> None:
        """Requests taken but not admitted yet: first again, in their order."""
        with self._ready:
            self._queue.extendleft(reversed(requests))

    def peek(self, most: int) -> list[list[int]]:
        """The prompts of the next `most` requests waiting, left waiting."""
        with self._ready:
            return [request.prompt_ids for request in itertools.islice(self._queue, most)]

    def take(self) -> Request | None:
        """The next request not cancelled while it waited, or None if none is waiting; those
        cancelled go to `on_dropped`, where one is set (a server answers them)."""
        with self._ready:
            while self._queue:
                request = self._queue.popleft()
                if not request.cancelled:
                    return request
                if self.on_dropped is not None:
                    self.on_dropped(request)
        return None

    def drop_waiting(self) -> None:
        """Cancel every request still waiting and hand each to `on_dropped` now (Ctrl-C: a waiting
        client is answered at once, not after the rows running before it)."""
        with self._ready:
            waiting, self._queue = list(self._queue), deque()
        for request in waiting:
            request.cancelled = True
            if self.on_dropped is not None:
                self.on_dropped(request)

    @property
    def done(self) -> bool:
        return self.closed and not self._queue and not self._embeddings

    def wait(self) -> None:
        """Until a request or texts wait, or the inbox is closed."""
        with self._ready:
            self._ready.wait_for(lambda: self._queue or self._embeddings or self.closed)


def _mark_at(prompt: list[int], others: list) -> int:
    """Where a hybrid's prompt is best marked among the other prompts known: the length it shares
    with some of them that saves the most tokens over all (its length × how many share that much):
    a system prompt all share, not the word after it that one shares too; 0 where none shares any."""
    shared = np.array([common_prefix(prompt, other) for other in others] or [0])
    return int(max(shared, key=lambda length: (length * (shared >= length).sum(), length)))


class _Marks:
    """A hybrid's marks as an admission round sees them (`Admission.mark`): per row the prompt
    prefix whose state it keeps, and whether that state is there yet (not while a prefill has still
    to pass it). Rows admitted in the round take theirs in the order they are admitted, as
    `Slots.admit` copies rows in that order before it prefills any."""

    def __init__(self, marked: list[np.ndarray], prefilling: np.ndarray):
        self.tokens = list(marked)
        self.ready = [len(tokens) > 0 and not p for tokens, p in zip(marked, prefilling)]

    def source(self, prompt: list[int], start: int) -> tuple[int, int] | None:
        """(row, how many tokens) of the mark that takes most of the prompt, where it takes more than `start`."""
        found = max(((reusable(prompt, t, True), i) for i, t in enumerate(self.tokens) if self.ready[i]), default=None)
        return (found[1], found[0]) if found and found[0] > start else None

    def pending(self, prompt: list[int], start: int) -> bool:
        """Whether a mark not there yet would take more of the prompt than `start`."""
        return any(not self.ready[i] and reusable(prompt, t, True) > start for i, t in enumerate(self.tokens))

    def admit(self, row: int, prompt: list[int], source: int | None, mark: int) -> None:
        """Row `row` takes `prompt`, from `source`'s cache or its own, marking it at `mark` (0: none):
        it keeps the mark it took (copied with the source's K/V) while the prompt extends it."""
        taken = row if source is None else source
        if mark:
            self.tokens[row], self.ready[row] = np.asarray(prompt[:mark], np.int32), False
        elif len(kept := self.tokens[taken]) and reusable(prompt, kept, True) == len(kept):
            self.tokens[row], self.ready[row] = kept, self.ready[taken]
        else:
            self.tokens[row], self.ready[row] = np.zeros(0, np.int32), False


class _Listed(Inbox):
    """A batch job's requests: all there from the start, taken in order."""

    def __init__(self, requests: Iterable[Request]):
        super().__init__()
        self._queue.extend(requests)
        self.closed = True


@dataclass
class _Slot:
    request: Request
    text: TextStream | None  # None for a client of token ids
    timings: Timings  # the request's own, or one of the row's
    admitted: float  # perf_counter as its admission began
    first_token: float | None = None
    last_token: float = 0.0  # perf_counter when the row's latest tokens reached the host
    compiling_s: float = 0.0  # compile time since the row's latest tokens (or its admission): not its latency
    compiled_s: float = 0.0  # all compile time after its first token
    read: int = 0  # the row's length as last collected
    passes: int = 0  # its decode passes counted into its timings' kv_read
    experts_read: int | None = None  # the cache's count of experts read as last collected after its first token
    logprobs: list = field(default_factory=list)  # where asked for and read as text: its tokens' (chosen, ids, top)


@dataclass
class BatchStats:
    generated_tokens: int = 0
    finished: int = 0
    cached_tokens: int = 0  # prompt tokens taken from rows' caches instead of prefilled
    compile: CompileReport = field(default_factory=CompileReport)


class Scheduler:
    """B rows and the loop that drives them (`turn`). `model`: its config, params, eos_ids and
    tokenizer (None: the rows' clients read token ids). How many decode steps a dispatch runs:
    `pace`, from `interval_s` (streaming: about that long a dispatch, so text reaches clients and
    new requests their rows that often) up to `max_steps`; without it (a batch job) `max_steps`."""

    def __init__(
        self,
        model: LoadedModel,
        batch_size: int,
        max_context: int,
        decoding: Decoding = Decoding(),
        interval_s: float | None = None,
        max_steps: int = CHUNK_STEPS,
    ):
        self.model, self.batch_size, self.max_context = model, batch_size, max_context
        self.slots = Slots(model.config, model.params, batch_size, max_context, model.eos_ids, decoding)
        self.stats = BatchStats()
        self.pace(interval_s, max_steps)
        self._started = time.perf_counter()  # a request's arrival where it gives none
        self.forget()  # the Slots start empty

    def reset(self) -> None:
        """An empty cache, every row free: nothing of earlier requests is reused."""
        self.slots.reset()
        self.forget()

    def forget(self) -> None:
        """Every row free and taken to hold nothing: no later request reuses what they held (the
        cache stays as it is; benchmarks' cold arrivals)."""
        self.rows: list[_Slot | None] = [None] * self.batch_size
        self._held = [np.zeros(0, np.int32)] * self.batch_size  # per row: the tokens whose K/V it holds, from 0
        self._kept = [np.zeros(0, np.int32)] * self.batch_size  # per row: the prompt whose end state it kept
        self._marked = [np.zeros(0, np.int32)] * self.batch_size  # per row: the prefix it kept the state after

    def pace(self, interval_s: float | None, max_steps: int = CHUNK_STEPS) -> None:
        """Dispatches from now on: as many decode steps as fit in about `interval_s` (the first one
        step), at most `max_steps`; `max_steps` each where `interval_s` is None."""
        self.interval_s, self.max_steps = interval_s, max_steps
        self._steps = max_steps if interval_s is None else 1
        self._dispatched: float | None = None  # perf_counter of the last dispatch
        self._kv_len = 0  # cache positions its steps attended over

    @property
    def busy(self) -> int:
        """Rows running a request."""
        return sum(row is not None for row in self.rows)

    def run(self, requests: Iterable[Request] | Inbox, on_result: Callable[[dict], None], continuous: bool = True):
        """Generate every request (those of a list, or those put in an `Inbox` until it is closed);
        `on_result(record)` is called as each one finishes. `continuous=False` is static batching."""
        inbox = requests if isinstance(requests, Inbox) else _Listed(requests)
        self._started = time.perf_counter()
        while True:
            if not self.turn(inbox, on_result, continuous):
                if inbox.done:
                    return
                inbox.wait()

    def turn(self, inbox: Inbox, on_result: Callable[[dict], None] | None = None, continuous: bool = True) -> bool:
        """One round of the loop every driver runs: admit waiting requests into free rows, collect
        what the last dispatch made (new text or tokens to the clients; finished rows handed over,
        `on_result(record)` for a request read as text, and freed), dispatch the next decode steps.
        Texts waiting to be embedded are embedded first, all in the same passes. The dispatch runs
        on while the caller goes on (it waits at the next round's collect). False where no row
        runs: nothing to wait for but the inbox."""
        embeddings.run_jobs(self.model, inbox.take_embeddings())
        if continuous or not self.busy:
            self._admit(inbox, wait_for_mates=continuous)
        if not self.busy:
            return False
        made = self._collect(on_result)
        if made < 0 and len(inbox) and continuous:
            return True  # fill the freed rows before decoding on
        if self.busy:
            self._dispatch(made)
        return True

    def _dispatch(self, made: int) -> None:
        """The next decode steps of every live row, sized by `pace` from the last dispatch's time
        per token (the most `made` by a row)."""
        if self.interval_s is not None and self._dispatched is not None and made > 0:
            per_token = (time.perf_counter() - self._dispatched) / made
            steps = max(1, min(self.max_steps, int(self.interval_s / max(per_token, 1e-6))))
            self._steps = agree(steps)  # joined processes run the same programs
        stop_point()  # joined processes: a Ctrl-C in the first stops all here
        report = CompileReport()
        self._dispatched = time.perf_counter()
        self._kv_len = self.slots.step(self._steps, report, stop_on_finish=True).kv_len
        self._compiled(report, filter(None, self.rows))

    def _compiled(self, report: CompileReport, rows: Iterable[_Slot]) -> None:
        """A call's compile time is the scheduler's, and no part of the latency of the rows that waited for it."""
        self.stats.compile.add(report)
        for slot in rows:
            slot.compiling_s += report.seconds
            slot.timings.compile.add(report)

    def _admit(self, inbox: Inbox, wait_for_mates: bool = True) -> None:
        """Take a request for every free slot and prefill them in one call (grouped by
        `Slots.admit`). Each goes to the free row that holds the longest prefix of its prompt, and
        takes a longer one from any other row that holds it (a running row's prompt, a free row's
        last sequence: the same system prompt, one prompt asked for n times) by copying its K/V.
        A prompt sharing more with one admitted now or still prefilling waits for it
        (`wait_for_mates`): one prefill serves both, the second a step later."""
        free = [i for i in range(self.batch_size) if self.rows[i] is None]
        if not free or not len(inbox):
            return
        # Rows by their first MIN_REUSE tokens (a prefix shorter than that is not reused): those
        # whose K/V may be copied (not still prefilling), and the prompts still to be prefilled.
        # A hybrid's row knows its state only where it kept it (`buckets.reusable`'s `whole`): a
        # free row's after all it holds, after its last prompt and at its mark; a running row's at
        # its mark (`delta_net.SNAPSHOTS`).
        draft = self.slots.speculation.model
        prefilling, whole = self.slots.prefilling, self.model.config.recurrent or bool(draft and draft.recurrent)
        holders: dict[tuple, list] = defaultdict(list)
        mates: dict[tuple, list] = defaultdict(list)
        for i, slot in enumerate(self.rows):
            if whole and slot is not None:
                continue
            tokens = self._held[i] if slot is None else slot.request.prompt_ids
            (mates if prefilling[i] else holders)[tuple(tokens[:MIN_REUSE])].append((i, np.asarray(tokens, np.int32)))
        marks = _Marks(self._marked, prefilling) if whole else None
        snapshots = {"prompt": self._kept, "mark": marks.tokens} if marks else {}  # a free row's, by name
        known = [self._held[i] if slot is None else slot.request.prompt_ids for i, slot in enumerate(self.rows)]
        admitted: list[tuple] = []  # row, start, source, restore, mark, request
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
            held = [reusable(prompt, self._held[i], whole) for i in free]
            kept = {name: [reusable(prompt, rows[i], True) for i in free] for name, rows in snapshots.items()}
            reach = [max([held[k], *(kept[name][k] for name in kept)]) for k in range(len(free))]
            # the row holding most of the prompt; among equals, the one holding least (kept for its own)
            best = max(range(len(free)), key=lambda k: (reach[k], -len(self._held[free[k]])))
            start, source = reach[best], None
            restore = next((name for name in kept if kept[name][best] == start > held[best]), None)
            key = tuple(prompt[:MIN_REUSE])
            for i, tokens in holders.get(key, ()):
                if (shared := reusable(prompt, tokens, whole)) > start:
                    start, source, restore = shared, i, None
            if marks and (found := marks.source(prompt, start)):
                source, start, restore = *found, "mark"
            later = marks.pending(prompt, start) if marks else any(reusable(prompt, m) > start for _, m in mates[key])
            if wait_for_mates and later:
                waiting.append(request)
                continue
            # A hybrid's prompt that shares more with another than it can take (a row's, or one
            # admitted or waiting: many clients' one system prompt) keeps its state where they part
            mark = 0
            if marks:
                shared = _mark_at(prompt, known + [r.prompt_ids for r in waiting] + inbox.peek(self.batch_size))
                mark = shared if shared - start >= MIN_REUSE else 0
            row = free.pop(best)
            admitted.append((row, start, source, restore, mark, request))
            mates[key].append((None, np.asarray(prompt, np.int32)))
            known.append(prompt)
            # not a source for later requests: a copy into it (this one's) runs before theirs out of it
            held_by_row = holders[tuple(self._held[row][:MIN_REUSE])]
            held_by_row[:] = [(i, tokens) for i, tokens in held_by_row if i != row]
            if marks:
                marks.admit(row, prompt, source, mark)
        inbox.put_back(waiting)
        if not admitted:
            return
        if any(r.logprobs is not None for *_, r in admitted):
            self.slots.record_logprobs()
        if any(r.constraint is not None for *_, r in admitted):
            self.slots.constrain(self.model.tokenizer)
        if any(r.logit_bias or penalized(r.sampling) for *_, r in admitted):
            self.slots.penalize()
        if any(r.min_tokens or r.thinking for *_, r in admitted):
            self.slots.guard(next((r.thinking for *_, r in admitted if r.thinking), None))
        timings: list[Timings] = []  # known before the prefill runs: an interrupted one (chat's Ctrl-C) says them too
        if marks:
            self._marked = marks.tokens
        for i, start, *_, request in admitted:
            self._held[i] = np.asarray(request.prompt_ids[:start], np.int32)  # prefill overwrites what follows
            self._kept[i] = np.zeros(0, np.int32)  # until this prompt is in
            timings.append(request.timings if request.timings is not None else Timings())
            timings[-1].prompt_tokens, timings[-1].cached_tokens = len(request.prompt_ids), start
        began, report = time.perf_counter(), CompileReport()
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
                    min_tokens=r.min_tokens,
                    thinking=r.thinking,
                    source=source,
                    restore=restore,
                    mark=mark,
                )
                for i, start, source, restore, mark, r in admitted
            ],
            report,
        )
        for (i, *_, request), timing in zip(admitted, timings):
            text = None if request.on_tokens else TextStream(self.model.tokenizer, request.prompt_ids, request.stop)
            self.rows[i] = _Slot(request, text, timing, began, read=len(request.prompt_ids))
            timing.cached_tokens = self.slots.admitted(i).start  # none where longrope's factors changed
            self.stats.cached_tokens += timing.cached_tokens
        self._compiled(report, (self.rows[i] for i, *_ in admitted))

    def _collect(self, on_result: Callable[[dict], None] | None) -> int:
        """Pass each live row's new tokens to its client (its text, or its `on_tokens`); hand over
        and free the finished rows. Returns the most tokens a row made since the last call, or -1
        if a row was freed."""
        tokens, length, done = self.slots.fetch()
        prefilling, counters = self.slots.prefilling, self.slots.counters
        asked = any(slot and slot.request.logprobs is not None for slot in self.rows)
        lp = self.slots.fetch_logprobs() if asked else None
        now = time.perf_counter()
        finished = np.zeros(self.batch_size, bool)
        most = 0
        for i, slot in enumerate(self.rows):
            if slot is None or prefilling[i]:  # a long prompt between chunks: no token yet
                continue
            request, end = slot.request, int(length[i])
            made = end - slot.read
            most = max(most, made)
            self._time(slot, made, now, int(counters.passes[i]))
            if request.speculate:
                decoded = end - len(request.prompt_ids) - 1
                slot.timings.speculation = Speculated(
                    int(counters.drafted[i]), int(counters.accepted[i]), int(counters.passes[i]), decoded
                )
            new = [int(t) for t in tokens[i, slot.read : end]]
            logprobs = [] if request.logprobs is None else [lp.at(i, p) for p in range(slot.read, end)]
            slot.read = end
            self.stats.generated_tokens += made
            if slot.text is not None:
                self._read_text(slot, new, logprobs)
            if done[i] or (slot.text is not None and slot.text.stopped) or request.cancelled:
                finished[i] = True
                self.stats.finished += 1
                eos = bool(done[i]) and not request.ignore_eos and int(tokens[i, end - 1]) in self.model.eos_ids
                unfinished = request.constraint is not None and not self.slots.matchers.complete(i)
                reason = (
                    "cancelled"
                    if request.cancelled
                    else "stop"
                    if slot.text is not None and slot.text.stopped
                    else finish_reason(eos, end - len(request.prompt_ids) >= request.max_tokens, unfinished)
                )
                if request.on_tokens:
                    request.on_tokens(new, logprobs, reason)
                elif on_result is not None:
                    on_result(self._record(slot, reason, now))
                self.rows[i] = None
                self._held[i] = tokens[i, : end - 1].copy()  # the last one's K/V the next step writes
                if end > len(request.prompt_ids):  # its prompt went in whole
                    self._kept[i] = np.asarray(request.prompt_ids, np.int32)
                if end < len(self._marked[i]):  # cancelled before its prefill reached its mark
                    self._marked[i] = np.zeros(0, np.int32)
            elif request.on_tokens and new:
                request.on_tokens(new, logprobs, None)
        if (stopped := finished & ~done).any():
            self.slots.retire(stopped)  # a stop string, a cancel: the row stops now
        return -1 if finished.any() else most

    def _time(self, slot: _Slot, made: int, now: float, passes: int) -> None:
        """The row's timings, after it made `made` tokens by `now` over `passes` decode passes in all:
        TTFT and each inter-token gap (others' admissions included, compiles not), spread over the
        tokens that came together; the cache positions its passes read."""
        timings = slot.timings
        # its passes since the last collection read lengths from its length then (after the prefill's
        # token, if that came since) to its length now - 1
        first = slot.read + (slot.first_token is None and made > 0)
        kv = self.slots.state.cache.positions_read(self.model.config, self._kv_len, first, slot.read + made - 1)
        timings.kv_read += (passes - slot.passes) * kv
        if slot.first_token is not None and slot.experts_read is not None:
            timings.experts_read += (self.slots.experts_read - slot.experts_read) % 2**32
            timings.experts_passes += passes - slot.passes
        slot.experts_read = self.slots.experts_read
        if slot.first_token is None:
            slot.first_token = now
            timings.ttft_s = now - slot.admitted - slot.compiling_s
        elif made:
            timings.itl_s += [(now - slot.last_token - slot.compiling_s) / made] * made
            slot.compiled_s += slot.compiling_s
        if made:
            slot.last_token, slot.compiling_s = now, 0.0
        timings.generated_tokens += made
        timings.decode_s = slot.last_token - slot.first_token - slot.compiled_s
        slot.passes = passes

    def _read_text(self, slot: _Slot, new: list[int], logprobs: list) -> None:
        """The row's new tokens through its text (up to a stop string), the text to its request's
        `on_text` as it comes."""
        request, pieces, first = slot.request, [], len(slot.text.token_ids)
        for k, token in enumerate(new):
            pieces.append(slot.text.push(token))
            if request.logprobs is not None:
                slot.logprobs.append(logprobs[k])
            if slot.text.stopped:
                break
        if request.on_text and pieces:
            request.on_text("".join(pieces), len(pieces), self._entries(slot, first))

    def _entries(self, slot: _Slot, first: int) -> list[dict]:
        """The logprob entries of the slot's tokens from `first` on, where its request asks."""
        if slot.request.logprobs is None:
            return []
        tokens = slot.text.token_ids[first:]
        return logprob_entries(self.model.tokenizer, tokens, slot.logprobs[first:], slot.request.logprobs)

    def _record(self, slot: _Slot, reason: str, now: float) -> dict:
        """A finished request read as text: what batch writes and serve answers."""
        text, request, timings = slot.text, slot.request, slot.timings
        text.flush()
        generated = len(text.token_ids)
        arrived = self._started if request.arrived is None else request.arrived
        decode_s = timings.decode_s
        itl_ms = [1000 * s for s in timings.itl_s] or [0.0]
        speculated = timings.speculation
        return (
            {
                "id": request.id,
                "text": text.text,
                "prompt_tokens": len(request.prompt_ids),
                "generated_tokens": generated,
                "cached_tokens": timings.cached_tokens,
                "finish_reason": reason,
                **({"stop_string": text.stop_string} if reason == "stop" and text.stop_string else {}),
                "seed": request.seed,
                "timings": {
                    "queued_s": round(slot.admitted - arrived, 4),
                    "ttft_s": round(timings.ttft_s, 4),
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
