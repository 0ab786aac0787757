"""The one owner of the device state: B sequence rows over one preallocated cache, and the compiled
programs that advance them. `Engine` (run, chat: one row) and `Scheduler` (batch: B rows) and
`jaxinfer bench` all drive generation through `admit` / `step` / `fetch` / `retire`.

Prompts longer than `prefill_chunk` tokens are prefilled a chunk per call (Sarathi's chunked
prefill): attention scores stay [chunk, kv bucket] instead of [T, T] per head, and while other rows
are decoding each `step` runs one chunk with one decode step of theirs, so a long admission delays
the running rows by a chunk at a time instead of stalling them for its whole prefill. The step rides
in the chunk's own pass over the weights (Sarathi's piggybacking: `prefill`'s `step_kv_len`), so it
costs them the chunk's time and little more (SmolLM-135M shape, B = 2: a 16-token chunk at position
2900 with the step 64 ms, apart 61 + 23 ms). Beside decoding rows the chunk is sized by the clock,
as a token budget (Sarathi's) sized for this machine and model: it doubles while a round's chunks
add under STALL of their plain decode steps and halves above, so a running row's longest wait stays
near (1 + STALL) × its inter-token latency whatever the model, batch or CPU; alone, a prompt goes in
`prefill_chunk`s (the fastest TTFT).

longrope (Phi-3.5, Phi-4-mini): transformers rotates a sequence with the short factors until it
grows past the original context, and there recomputes its whole cache with the long ones. Here the
decode loop stops a row at that point and `step` prefills it again whole (in chunks, beside the
running rows): the same keys, the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.buckets import (
    MIN_BUCKET,
    PREFILL_CHUNK,
    PREFILL_CHUNK_ACCELERATOR,
    PREFILL_CHUNK_KERNEL,
    check_memory,
    chunk_size,
    kv_bucket,
    prompt_bucket,
)
from jaxinfer.config import ModelConfig, longrope_switch
from jaxinfer.constrain import Constraint, check_one_process
from jaxinfer.decode import catch_up, decode, prefill
from jaxinfer.errors import JaxinferError
from jaxinfer.matchers import HostCall, Matchers
from jaxinfer.processes import agree
from jaxinfer.replies import Thinking
from jaxinfer.roofline import Storage
from jaxinfer.runtime import CompileReport, Programs, check_backend, interrupts_held
from jaxinfer.sampling import Guards, Penalties, Sampling
from jaxinfer.sharding import mesh_of, state_shardings
from jaxinfer.state import DecodeState, Logprobs, Speculation, admission, copy_rows, initial_state, restore_rows, retire

# Beside decoding rows, a round's chunks may add this many of their decode steps' time: a gap of
# about 3 steps (bench_admission.py, one sitting: ×3.1 of the median at 2, ×4.3 at 3, whose
# overshoot as the chunks' attention grows crossed 4; the long prompt's TTFT 8.9 s and 11.0 s).
STALL = 2.0


@dataclass(frozen=True)
class Decoding:
    """How rows are prefilled and decoded, beyond the model and each row's sampling:
    - `prefill_chunk`: prompt tokens per prefill call, rounded down to a power of two (`chunk_size`);
      0 is the whole prompt in one call; None the path's own (`PREFILL_CHUNK_KERNEL` where the CPU
      attention kernel runs, else `PREFILL_CHUNK`);
    - `speculation` (`state.Speculation`; off by default);
    - `draft_params`: the draft model's parameters, where one drafts (its config is `speculation.model`)."""

    prefill_chunk: int | None = None
    speculation: Speculation = Speculation()
    draft_params: dict | None = None

    def __post_init__(self):
        if self.prefill_chunk is not None and self.prefill_chunk != 0 and self.prefill_chunk < MIN_BUCKET:
            raise JaxinferError(f"prefill_chunk must be 0 (off) or at least {MIN_BUCKET}", "prefill_chunk")
        if (self.speculation.model is None) != (self.draft_params is None):
            raise ValueError("a draft model needs both its config (Speculation.model) and its parameters")

    @property
    def speculating(self) -> bool:
        return self.speculation.draft > 0


@dataclass
class Admission:
    """One sequence to start in a row: its prompt, of which the first `start` tokens' K/V the row
    already holds (a chat's earlier turns) or row `source` does (the same system prompt, a prompt
    asked for n times: copied over before anything is prefilled), and how it is to be generated."""

    row: int
    prompt: list[int]
    max_tokens: int
    seed: int
    sampling: Sampling
    start: int = 0
    ignore_eos: bool = False
    speculate: bool = False  # draft, where the Slots speculate
    constraint: Constraint | None = None  # what the output must match (`jaxinfer.constrain`; the Slots `constrain`)
    logit_bias: dict[int, float] | None = None  # token id → added to its logit (the Slots `penalize`)
    min_tokens: int = 0  # no EOS id before this many tokens (the Slots `guard`)
    thinking: Thinking | None = None  # a thinking block's budget (the Slots `guard`)
    source: int | None = None  # the row holding the first `start` tokens' K/V, where not this one
    # a hybrid's row takes the DeltaNet state it (or `source`) kept after the first `start` tokens
    # (`delta_net.SNAPSHOTS`: "prompt", the end of its last prompt; "mark", its mark), not the one
    # after all it holds
    restore: str | None = None
    mark: int = 0  # a hybrid's: keep the state after this many prompt tokens too (0: none)

    @property
    def penalized(self) -> bool:
        """Needs the Slots' `penalize`: a logit bias, or presence/frequency penalties."""
        return bool(self.logit_bias) or penalized(self.sampling)

    @property
    def guarded(self) -> bool:
        """Needs the Slots' `guard`: a floor under EOS, or a thinking budget."""
        return self.min_tokens > 0 or self.thinking is not None


def penalized(sampling: Sampling) -> bool:
    return sampling.presence_penalty != 0 or sampling.frequency_penalty != 0


@dataclass
class Counters:
    """Per row [B], since it started: draft tokens verified, of them kept, and decode passes."""

    drafted: np.ndarray
    accepted: np.ndarray
    passes: np.ndarray


@dataclass
class Step:
    """What one `step` call ran: at most `steps` decode steps over `kv_len` cache positions."""

    steps: int
    kv_len: int


class Slots:
    """B rows over one fixed-shape cache of `max_context` positions.

    The host keeps a bound on each row's length (exact after `fetch`, an upper bound after `step`,
    since rows may finish early on the device): enough to choose kv buckets without a round trip.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        batch: int,
        max_context: int,
        eos_ids: tuple[int, ...],
        decoding: Decoding = Decoding(),
    ):
        self.cfg, self.params, self.batch, self.max_context, self.eos_ids = cfg, params, batch, max_context, eos_ids
        # over abstract weights (`jax.ShapeDtypeStruct`s, as they will load): calls compile their
        # programs and run nothing; JAX keeps what they compiled for the real ones (`engine.compile_ahead`)
        self.dry = isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
        speculation, draft_params = self.speculation, self.draft_params = decoding.speculation, decoding.draft_params
        draft = speculation.model and (speculation.model, Storage.of_params(draft_params))
        check_memory(cfg, Storage.of_params(params), batch, max_context, draft, mesh_of(params))
        self.recording = False  # each token's log-probabilities (`record_logprobs`)
        self.penalizing = False  # rows may have a logit bias or presence/frequency penalties (`penalize`)
        self.markers: tuple | None = None  # rows may have guards, with these thinking markers (`guard`)
        self.matchers: Matchers | None = None  # where rows may be constrained (`constrain`)
        self._shape()
        self.reset()
        prefill_chunk = decoding.prefill_chunk
        if prefill_chunk is None:  # the path's own: flash attention (the CPU kernel's, cuDNN's) keeps big chunks cheap
            prefill_chunk = (
                PREFILL_CHUNK_KERNEL
                if self.state.cache.kernel == "cpu"
                else PREFILL_CHUNK
                if check_backend() == "cpu"
                else PREFILL_CHUNK_ACCELERATOR
            )
        self.prefill_chunk = chunk_size(prefill_chunk)
        # the chunk beside decoding rows: from the clock (`_pace`)
        self.beside_chunk = min(MIN_BUCKET, self.prefill_chunk)

    def _shape(self) -> None:
        """How `reset` makes an empty state, and over a mesh where it is placed (made in place on
        its devices, and kept there). A state of another shape needs programs of its own: those
        compiled for the last shape are dropped (it never comes back)."""
        self._programs = Programs()  # prefill per (rows, bucket, kv_len); decode per kv_len
        self._empty = partial(
            initial_state,
            self.cfg,
            self.params,
            self.batch,
            self.max_context,
            self.eos_ids,
            self.speculation,
            self.draft_params,
            self.recording,
            self.matchers is not None,
            self.penalizing,
            self.markers,
        )
        mesh = mesh_of(self.params)
        self._placed = (
            None
            if mesh is None
            else state_shardings(jax.eval_shape(self._empty), mesh, self.cfg, self.speculation.model)
        )

    def record_logprobs(self) -> None:
        """From now on, record each new token's log-probabilities (`fetch_logprobs`) in every row:
        the state grows by [B, S, 2 × TOP_LOGPROBS] values and the programs compile once more.
        Rows already running keep their place (their earlier tokens read zeros)."""
        if not self.recording:
            self.recording = True
            self._grow(logprobs=Logprobs.zeros(self.batch, self.max_context, self.cfg))

    def penalize(self) -> None:
        """Let admissions carry a logit bias and presence/frequency penalties from now on: the state
        gains every row's bias and counts of generated tokens ([B, V] each, read every step: only
        states that ask pay it) and the programs compile once more. A penalized row drafts nothing
        (the checking pass would need counts per drafted position)."""
        if not self.penalizing:
            self.penalizing = True
            self._grow(penalties=Penalties.zeros(self.batch, self.cfg.vocab_size))

    def guard(self, thinking: Thinking | None = None) -> None:
        """Let admissions carry a floor under EOS and a thinking budget (`thinking`'s markers) from
        now on: the state gains every row's guards ([B] each, with the markers: `sampling.Guards`)
        and the programs compile once more (again where other markers come: running rows keep
        theirs). A guarded row drafts nothing (its count would move inside a verifying pass)."""
        markers = thinking.markers if thinking is not None else self.markers or ((), (), ())
        if markers != self.markers:
            guards = Guards.zeros(self.batch, markers)
            if self.markers is not None:
                guards = replace(self.state.guards, opener=guards.opener, closer=guards.closer, forced=guards.forced)
            self.markers = markers
            self._grow(guards=guards)

    def constrain(self, tokenizer) -> None:
        """Let admissions carry a `constraint` from now on: the state gains every row's token mask
        and the programs compile once more, with the host callback that advances the matchers
        (`jaxinfer.matchers`). Over a mesh it runs once a step, on the first device (`matchers.HostCall`);
        not over processes joined in one (the matchers live in one process)."""
        if self.matchers is not None:
            return
        check_one_process()
        self.matchers = Matchers(tokenizer, self.cfg.sampled_ids, self.batch, self.eos_ids)
        self._grow(allowed=self.matchers.masks)

    def _grow(self, **fields) -> None:
        """The state of the new shape (`_shape`): the running one with these fields added, placed
        as the new shape's state is."""
        self._shape()
        if self._placed is not None:
            fields = {name: jax.device_put(value, getattr(self._placed, name)) for name, value in fields.items()}
        else:
            fields = jax.device_put(fields)
        with interrupts_held():  # as `_call`
            self.state = replace(self.state, **fields)

    def fetch_logprobs(self) -> Logprobs:
        """Every row's recorded log-probabilities on the host (numpy arrays: chosen [B, S], ids and
        top [B, S, N], by position)."""
        return Logprobs(*jax.device_get(tuple(vars(self.state.logprobs).values())))

    def reset(self) -> None:
        """An empty cache, every row free."""
        if self.dry:
            self.state: DecodeState = jax.eval_shape(self._empty)
        else:
            self.state = self._empty() if self._placed is None else jax.jit(self._empty, out_shardings=self._placed)()
        self._length = np.zeros(self.batch, np.int64)  # ≥ each row's true length
        self._limit = np.zeros(self.batch, np.int64)
        self._live = np.zeros(self.batch, bool)  # not known to be done
        self._queue: dict[int, tuple[Admission, int]] = {}  # row → its admission, prompt tokens prefilled so far
        self._admitted: dict[int, Admission] = {}  # row → what it runs
        self._long = np.zeros(self.batch, bool)  # longrope: the row's keys take the long factors
        self._carried = Counters(*(np.zeros(self.batch, np.int32) for _ in range(3)))  # from before a second prefill
        self._step_s: float | None = None  # a decode step beside this admission's chunks, as timed
        self.counters = Counters(*(np.zeros(self.batch, np.int32) for _ in range(3)))
        self.experts_read: int | None = None  # `KVCache.experts_read` as last fetched

    @property
    def lost(self) -> bool:
        """The state was donated to a call that never returned (interrupted): `reset` before use."""
        return self.state.cache.k[0].is_deleted()

    @property
    def prefilling(self) -> np.ndarray:
        """[B] bool: rows admitted whose prompt is still being prefilled (no token yet)."""
        return np.isin(np.arange(self.batch), list(self._queue))

    def admitted(self, row: int) -> Admission:
        """What the row runs, as admitted (its `start`: the prompt tokens it took from the cache)."""
        return self._admitted[row]

    def admit(self, admissions: list[Admission], report: CompileReport) -> None:
        """Start the given rows (replacing whatever they held); other rows keep their place. Each
        prompt + max_tokens must fit max_context (callers check: `check_fits`). With no row
        decoding, every prompt is prefilled now and each row has its first token; otherwise prompts
        longer than a chunk are only queued, and `step` prefills them a chunk at a time."""
        rows = np.zeros(self.batch, bool)
        rows[[a.row for a in admissions]] = True
        if (self._live & rows).any():  # their earlier sequences stop decoding now
            self.retire(rows)
        if self.matchers is not None:
            jax.block_until_ready(self.state)  # the callbacks of calls in flight have run
            for a in admissions:
                self.matchers.start(a.row, a.constraint)
        elif any(a.constraint for a in admissions):
            raise ValueError("a constraint needs Slots.constrain first")
        if not self.penalizing and any(a.penalized for a in admissions):
            raise ValueError("a logit bias or presence/frequency penalties need Slots.penalize first")
        if any(a.guarded for a in admissions) and (
            self.markers is None or any(a.thinking and a.thinking.markers != self.markers for a in admissions)
        ):
            raise ValueError("a floor under EOS or a thinking budget needs Slots.guard first, with its markers")
        if switch := longrope_switch(self.cfg):  # cached keys rotated with the other factors are of no use
            holder = lambda a: a.row if a.source is None else a.source  # noqa: E731
            admissions = [
                a if self._long[holder(a)] == (len(a.prompt) > switch) else replace(a, start=0) for a in admissions
            ]
            for a in admissions:
                self._long[a.row] = len(a.prompt) > switch
        for a in admissions:  # before any row of this call is prefilled: a source may be one of them
            if a.start and a.source not in (None, a.row):
                args = jax.device_put((np.array([a.source], np.int32), np.array([a.row], np.int32)))
                self._call(self._program(("copy",), report, copy_rows, *args, constrained=False), *args)
            if a.start and a.restore:
                args, static = jax.device_put((np.array([a.row], np.int32),)), dict(snapshot=a.restore)
                program = self._program(
                    ("restore", a.restore), report, restore_rows, *args, constrained=False, **static
                )
                self._call(program, *args)
            if a.start and self.speculation.model and a.restore != "mark":  # the draft lags the prefix by a token
                args = jax.device_put((np.array([a.row], np.int32), np.array([a.start], np.int32)))
                args += (self.draft_params,)
                kv_len = kv_bucket(a.start, self.max_context)
                static = dict(spec=self.speculation, kv_len=kv_len)
                self._call(
                    self._program(("catch up", kv_len), report, catch_up, *args, constrained=False, **static), *args
                )
        for a in admissions:
            self._admitted[a.row] = a
            for counter in vars(self._carried).values():
                counter[a.row] = 0
        self._queue.update({a.row: (a, a.start) for a in admissions})
        if self._live.any():  # rows are decoding: only what takes one chunk beside them
            self._prefill_round(report, self.beside_chunk, whole_only=True)
        while self._queue and not self._live.any():
            self._prefill_round(report, self.prefill_chunk)

    def _prefill_round(self, report: CompileReport, chunk: int, whole_only: bool = False, step_kv_len: int = 0) -> None:
        """One chunk of every queued prompt (`whole_only`: of those whose rest fits one chunk). Rows
        go in groups of a power-of-four size (1, 4, 16, 64, ...), longest rest first, so the programs
        stay few (rows × prompt bucket × kv bucket × the step's) and a short prompt rarely pads to a
        long one. Powers of two made a server compile prefill programs round after round as its
        clients' arrival order found new group sizes (`scripts/bench_serve.py`, 64 clients: 1–2
        programs in the timed round, serve ÷ batch ×0.59–0.68; in groups of powers of four, 0–1,
        ×0.61–0.81). With `step_kv_len` the first group's call also steps the live rows (`prefill`)."""
        chunk = chunk or self.max_context
        rest = lambda row: len(self._queue[row][0].prompt) - self._queue[row][1]  # noqa: E731
        rows = sorted((row for row in self._queue if not whole_only or rest(row) <= chunk), key=rest, reverse=True)
        while rows:
            size = 4 ** ((len(rows).bit_length() - 1) // 2)  # the largest power of four in len(rows)
            group, rows = rows[:size], rows[size:]
            self._prefill([self._queue[row] for row in group], min(rest(group[0]), chunk), report, step_kv_len)
            step_kv_len = 0

    def _prefill(
        self, group: list[tuple[Admission, int]], most: int, report: CompileReport, step_kv_len: int = 0
    ) -> None:
        """Prefill up to `most` prompt tokens of each row of the group, from where it stands."""
        starts = [start for _, start in group]
        # a chunk ends at the row's mark, where the state is kept (`DeltaState.keep`)
        ends = [min(len(a.prompt), start + most, a.mark if a.mark > start else len(a.prompt)) for a, start in group]
        bucket = prompt_bucket(max(end - start for end, start in zip(ends, starts)), self.max_context)
        # A fresh prompt attends over its own bucket; a continuation over the kv bucket that holds it.
        kv_len = kv_bucket(max(starts) + bucket, self.max_context) if any(starts) else bucket
        limits = [len(a.prompt) + a.max_tokens for a, _ in group]
        admissions = [a for a, _ in group]
        args = admission(
            [a.row for a in admissions],
            [a.prompt for a in admissions],
            starts,
            ends,
            limits,
            [a.seed for a in admissions],
            [a.sampling for a in admissions],
            [a.ignore_eos for a in admissions],
            [a.speculate and not (a.penalized or a.guarded) for a in admissions],  # neither drafts
            bucket,
            None if self.matchers is None else self.matchers.masks[[a.row for a in admissions]],
            self._bias(admissions) if self.penalizing else None,
            None if self.markers is None else Guards.rows([_guards(a) for a in admissions]),
            [a.mark for a in admissions],
        )
        args += (self.draft_params,)
        fresh = not any(starts)
        static = dict(cfg=self.cfg, kv_len=kv_len, spec=self.speculation, step_kv_len=step_kv_len, fresh=fresh)
        key = ("prefill", len(group), bucket, kv_len, step_kv_len, fresh)
        self._call(self._program(key, report, prefill, *args, **static), *args)
        for a, end, limit in zip(admissions, ends, limits):
            if end < len(a.prompt):
                self._queue[a.row] = (a, end)
            else:
                del self._queue[a.row]
                self._length[a.row], self._limit[a.row], self._live[a.row] = len(a.prompt) + 1, limit, True

    def _bias(self, admissions: list[Admission]) -> np.ndarray:
        """The admitted rows' logit bias, dense [R, V]."""
        bias = np.zeros((len(admissions), self.cfg.vocab_size), np.float32)
        for i, a in enumerate(admissions):
            for token, value in (a.logit_bias or {}).items():
                bias[i, token] = value
        return bias

    def step(self, max_steps: int, report: CompileReport, stop_on_finish: bool = False) -> Step:
        """Run up to `max_steps` decode steps of every live row (fewer if one would leave its kv
        bucket; stopping at the first finished row with `stop_on_finish`). Returns what it ran.
        While prompts are queued, a chunk of each and one decode step: every running row gets a
        token per chunk (Sarathi's stall-free schedule). The first such round of an admission runs
        them apart, timing the plain step; after it the step rides in the chunk's pass (`prefill`'s
        `step_kv_len`), which then costs the running rows little more than the chunk."""
        if switch := longrope_switch(self.cfg):
            self._prefill_long_again(switch)
        queued = bool(self._queue)
        chunked = queued and self._live.any()  # beside decoding rows: timed
        if not chunked:
            self._step_s = None  # the next admission times the step again: the rows will have grown
        started, compiled = time.perf_counter(), report.seconds
        if chunked and self._step_s is not None:
            live = self._live.copy()
            kv_len = kv_bucket(int(self._length[live].max()), self.max_context)
            self._prefill_round(report, self.beside_chunk, step_kv_len=kv_len)
            self._advance(live, 1, kv_len)
            jax.block_until_ready(self.state)
            self._pace(time.perf_counter() - started - self._step_s, self._step_s, report.seconds > compiled)
            return Step(1, kv_len)
        if chunked:
            self._prefill_round(report, self.beside_chunk)
            jax.block_until_ready(self.state)
            chunks_s = time.perf_counter() - started
        while self._queue and not self._live.any():
            self._prefill_round(report, self.prefill_chunk)
        if not self._live.any():
            return Step(0, 0)
        longest = int(self._length[self._live].max())  # the next step's query sits at longest - 1
        kv_len = kv_bucket(longest, self.max_context)
        steps = 1 if queued else max(1, min(max_steps, kv_len - longest + 1))  # a new first token comes back at once
        args = jax.device_put((np.int32(steps), np.bool_(stop_on_finish))) + (self.draft_params,)
        spec = self.speculation
        run = self._program(("decode", kv_len), report, decode, *args, cfg=self.cfg, kv_len=kv_len, spec=spec)
        self._call(run, *args)
        self._advance(self._live, steps * (spec.draft + 1), kv_len)  # a speculative step makes up to draft + 1 tokens
        if chunked:
            jax.block_until_ready(self.state)
            step_s = time.perf_counter() - started - chunks_s
            self._step_s = None if report.seconds > compiled else step_s
            self._pace(chunks_s, step_s, report.seconds > compiled)
        return Step(steps, kv_len)

    def _advance(self, rows: np.ndarray, tokens: int, kv_len: int) -> None:
        """The host's bound on the lengths of rows [B] bool after a call that made up to `tokens`
        each: the loop ends where a row leaves the bucket, or reaches longrope's switch."""
        grown = np.minimum(self._length[rows] + tokens, kv_len + 1)
        if switch := longrope_switch(self.cfg):
            grown = np.where(self._length[rows] <= switch, np.minimum(grown, switch + 1), grown)
        self._length[rows] = np.minimum(grown, self._limit[rows])

    def _pace(self, chunks_s: float, step_s: float, compiled: bool) -> None:
        """The next chunk beside decoding rows, from the time this round's chunks added to a decode
        step of the running rows and that step's own: double while twice the chunks would fit STALL
        steps, halve while they do not (a compile in the round says nothing). Between MIN_BUCKET
        and `prefill_chunk`: few programs."""
        chunk = self.beside_chunk
        if not compiled and self.prefill_chunk:
            if 2 * chunks_s <= STALL * step_s:
                chunk = min(2 * chunk, self.prefill_chunk)
            elif chunks_s > STALL * step_s:
                chunk = max(chunk // 2, MIN_BUCKET)
        self.beside_chunk = agree(chunk)  # joined processes run the same programs

    def _call(self, program, *args) -> None:
        """The state through `program(params, state, *args)`, donated. Ctrl-C is held from the call
        to the assignment, so an interrupt never lands between them and leaves the state donated to
        a result nobody holds (`lost`, and a chat's cache with it: the chat test's second turn then
        found nothing cached, once in a few runs). It delays nothing: the call only dispatches, and
        a signal waits for a C call to return anyway."""
        if self.dry:  # compiled: that is all a dry run does
            return
        with interrupts_held():
            self.state = program(self.params, self.state, *args)

    def _program(self, key: tuple, report: CompileReport, phase, *args, constrained: bool = True, **static):
        """`phase` (prefill, decode, copy_rows) compiled for the state and these arguments, with
        the matchers' callback where rows may be constrained and the phase makes tokens. Over a mesh its state
        comes out placed as it went in: left to choose, XLA splits the seen-token mask by vocabulary
        as it does the logits, and the next call's state no longer matches the program."""
        if self.matchers is not None and constrained:
            mesh = mesh_of(self.params)
            static["constrain"] = HostCall(self.matchers, mesh and NamedSharding(mesh, PartitionSpec()))
        if self._placed is not None:
            phase = jax.jit(
                phase, static_argnames=tuple(static), donate_argnames=("state",), out_shardings=self._placed
            )
        return self._programs.get(key, report, phase, self.params, self.state, *args, **static)

    def _prefill_long_again(self, switch: int) -> None:
        """Queue every live row that has just grown past longrope's original context (the decode
        loop stops it there) to be prefilled again whole, with the long factors."""
        if not (self._live & (self._length == switch + 1)).any():
            return
        tokens, length, _ = self.fetch()  # the host's lengths are bounds: make them exact
        rows = self._live & (length == switch + 1)
        if not rows.any():
            return
        self.retire(rows)  # the loop passes them by until their last chunk
        for row in np.flatnonzero(rows):
            a = self._admitted[row]
            again = replace(
                a,
                prompt=tokens[row, : switch + 1].tolist(),
                max_tokens=len(a.prompt) + a.max_tokens - switch - 1,
                start=0,
            )
            self._admitted[row], self._queue[row], self._long[row] = again, (again, 0), True
            for carried, now in zip(vars(self._carried).values(), vars(self.counters).values()):
                carried[row] = now[row]  # the counters restart at a prefill
            self._carried.passes[row] += 1  # which makes the row's next token, as a decode pass would

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens [B, S], length [B], done [B] on the host (whole arrays: slicing on the device would
        dispatch programs of its own); the host's view of the rows becomes exact, and `counters`
        current."""
        s = self.state
        fetched = (s.tokens, s.length, s.done, s.cache.experts_read, s.drafted, s.accepted, s.passes)
        tokens, length, done, experts_read, *counters = jax.device_get(fetched)
        self._length[:], self._live[:] = length, ~done  # a prefilling row reads done, with no token yet
        self.experts_read = None if experts_read is None else int(experts_read)
        self.counters = Counters(*(now + carried for now, carried in zip(counters, vars(self._carried).values())))
        return tokens, length, done

    def retire(self, rows: np.ndarray) -> None:
        """Mark rows [B] bool as done (their text hit a stop string): the loop stops spending on them."""
        placed = jax.device_put(rows)
        with interrupts_held():  # as `_call`
            self.state = retire(self.state, placed)
        self._live &= ~rows


def _guards(a: Admission) -> tuple[int, int, bool]:
    """An admission's (floor, thinking budget or -1, opened by the prompt): `Guards.rows`."""
    floor = len(a.prompt) + a.min_tokens
    return (floor, -1, False) if a.thinking is None else (floor, a.thinking.tokens, a.thinking.opened)
