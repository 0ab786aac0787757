"""The one owner of the device state: B sequence rows over one preallocated cache, and the compiled
programs that advance them. `Engine` (run, chat: one row) and `BatchRunner` (batch: B rows) and
`jaxinfer bench` all drive generation through `admit` / `step` / `fetch` / `retire`.

Both phases attend over a power-of-two prefix of the cache (a *kv bucket*) that covers the longest
live row, never over the whole `max_context`: decode is bandwidth-bound and, on small models, the
cache read costs more than the weights (SmolLM-135M shape: decode at `-c 8192` ran at 0.18× the
speed of `-c 256` before this). Shapes stay static: one decode program per kv bucket, compiled when
a row first crosses into it, and a decode call never runs a row past its bucket (the host caps its
traced step count), so the next call picks the next bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.decode import DecodeState, admission, decode, initial_state, prefill, retire
from jaxinfer.runtime import CompileReport, Programs
from jaxinfer.sampling import Sampling

MIN_BUCKET = 16  # shortest padded prompt
MIN_KV_BUCKET = 128  # shortest kv prefix: below it the cache read is lost in the weights' (and programs cost compiles)


def _pow2_bucket(n: int, smallest: int, largest: int) -> int:
    return min(max(smallest, 1 << math.ceil(math.log2(max(n, 1)))), largest)


def prompt_bucket(n: int, max_context: int) -> int:
    """Padded prompt length: the next power of two (≥ 16), capped by the cache, so prompts of
    many lengths share one compiled prefill."""
    return _pow2_bucket(n, MIN_BUCKET, max_context)


def kv_bucket(n: int, max_context: int) -> int:
    """Cache positions attended by a program whose queries sit below position n."""
    return _pow2_bucket(n, MIN_KV_BUCKET, max_context)


@dataclass
class Admission:
    """One sequence to start in a row: its prompt, of which the first `start` tokens' K/V the row
    already holds (a chat's earlier turns), and how it is to be generated."""

    row: int
    prompt: list[int]
    max_tokens: int
    seed: int
    sampling: Sampling
    start: int = 0
    ignore_eos: bool = False


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

    def __init__(self, cfg: ModelConfig, params: dict, batch: int, max_context: int, eos_ids: tuple[int, ...]):
        self.cfg, self.params, self.batch, self.max_context, self.eos_ids = cfg, params, batch, max_context, eos_ids
        self._programs = Programs()  # prefill per (rows, bucket, kv_len); decode per kv_len
        self.reset()

    def reset(self) -> None:
        """An empty cache, every row free."""
        self.state: DecodeState = initial_state(self.cfg, self.params, self.batch, self.max_context, self.eos_ids)
        self._length = np.zeros(self.batch, np.int64)  # ≥ each row's true length
        self._limit = np.zeros(self.batch, np.int64)
        self._live = np.zeros(self.batch, bool)  # not known to be done

    @property
    def lost(self) -> bool:
        """The state was donated to a call that never returned (interrupted): `reset` before use."""
        return self.state.cache.k.is_deleted()

    def admit(self, admissions: list[Admission], report: CompileReport) -> None:
        """Prefill the given rows and sample each one's first token; other rows keep their place.
        Each prompt + max_tokens must fit max_context (callers check, in their own words). Rows go
        in groups of a power-of-two size, longest prompts together, so the programs stay few
        (rows × prompt bucket × kv bucket) and a short prompt rarely pads to a long one."""
        pending = sorted(admissions, key=lambda a: len(a.prompt) - a.start, reverse=True)
        while pending:
            size = 1 << (len(pending).bit_length() - 1)
            group, pending = pending[:size], pending[size:]
            self._prefill(group, report)

    def _prefill(self, group: list[Admission], report: CompileReport) -> None:
        bucket = prompt_bucket(max(len(a.prompt) - a.start for a in group), self.max_context)
        starts = [a.start for a in group]
        # A fresh prompt attends over its own bucket; a continuation over the kv bucket that holds it.
        kv_len = kv_bucket(max(starts) + bucket, self.max_context) if any(starts) else bucket
        limits = [len(a.prompt) + a.max_tokens for a in group]
        args = admission(
            [a.row for a in group], [a.prompt for a in group], starts, limits, [a.seed for a in group],
            [a.sampling for a in group], [a.ignore_eos for a in group], bucket,
        )
        run = self._programs.get(("prefill", len(group), bucket, kv_len), report, prefill, self.params, self.state, *args, cfg=self.cfg, kv_len=kv_len)
        self.state = run(self.params, self.state, *args)
        for a, limit in zip(group, limits):
            self._length[a.row], self._limit[a.row], self._live[a.row] = len(a.prompt) + 1, limit, True

    def step(self, max_steps: int, report: CompileReport, stop_on_finish: bool = False) -> Step:
        """Run up to `max_steps` decode steps of every live row (fewer if one would leave its kv
        bucket; stopping at the first finished row with `stop_on_finish`). Returns what it ran."""
        if not self._live.any():
            return Step(0, 0)
        longest = int(self._length[self._live].max())  # the next step's query sits at longest - 1
        kv_len = kv_bucket(longest, self.max_context)
        steps = max(1, min(max_steps, kv_len - longest + 1))
        args = jax.device_put((np.int32(steps), np.bool_(stop_on_finish)))
        run = self._programs.get(("decode", kv_len), report, decode, self.params, self.state, *args, cfg=self.cfg, kv_len=kv_len)
        self.state = run(self.params, self.state, *args)
        self._length[self._live] = np.minimum(self._length[self._live] + steps, self._limit[self._live])
        return Step(steps, kv_len)

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens [B, S], length [B], done [B] on the host (whole arrays: slicing on the device would
        dispatch programs of its own); the host's view of the rows becomes exact."""
        tokens, length, done = jax.device_get((self.state.tokens, self.state.length, self.state.done))
        self._length[:], self._live[:] = length, ~done
        return tokens, length, done

    def retire(self, rows: np.ndarray) -> None:
        """Mark rows [B] bool as done (their text hit a stop string): the loop stops spending on them."""
        self.state = retire(self.state, jax.device_put(rows))
        self._live &= ~rows
