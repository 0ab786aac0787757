"""Token sampling: user-facing settings on the host, and a pure sampler over per-row traced arrays.

Every knob reaches the compiled code as an array ([B] per field), so changing --temp, --top-p, ...
never recompiles. The order of the transforms follows transformers: repetition penalty, then
temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import JaxinferError


@dataclass(frozen=True)
class Sampling:
    """What the user asked for. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and
    repeat_penalty 1 switch those filters off. presence_penalty and frequency_penalty are OpenAI's
    (0 is off): subtracted from a token's logit once it was generated, and per time it was; they
    need a state that counts (`Penalties`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        # Named as the field (a batch line's too); NaN fails every comparison.
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be ≥ 0 (0 is greedy)"),
            ("top_k", _whole(self.top_k) and self.top_k >= 0, "must be a whole number ≥ 0 (0 turns it off)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p < 1, "must be in [0, 1)"),
            (
                "repeat_penalty",
                math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0,
                "must be > 0 (1 is off)",
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be from -2 to 2 (0 is off)"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be from -2 to 2 (0 is off)"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise JaxinferError(f"{name} {rule}", name)

    @classmethod
    def from_generation_config(cls, gc: dict) -> Sampling:
        """The model's defaults, read as transformers reads generation_config.json: without
        do_sample it decodes greedily, and sampling without a stated top_k uses 50."""
        if not gc.get("do_sample", False):
            return cls(repeat_penalty=float(gc.get("repetition_penalty") or 1.0))
        return cls(
            temperature=float(gc.get("temperature", 1.0) or 0.0),
            top_k=int(gc.get("top_k", 50) or 0),
            top_p=float(gc.get("top_p", 1.0) or 1.0),
            min_p=float(gc.get("min_p") or 0.0),
            repeat_penalty=float(gc.get("repetition_penalty") or 1.0),
        )


@jax.tree_util.register_dataclass
@dataclass
class SamplerArrays:
    """`Sampling` as traced values, one per batch row."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    repeat_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32

    @classmethod
    def from_settings(cls, rows: list[Sampling]) -> SamplerArrays:
        columns = {f.name: [getattr(r, f.name) for r in rows] for f in fields(Sampling)}
        columns["top_k"] = [min(k, 2**31 - 1) for k in columns["top_k"]]  # int32; any k ≥ the vocabulary is off
        # numpy, then one device_put: building on the device would dispatch a conversion program
        return jax.device_put(
            cls(
                **{
                    name: np.asarray(values, np.int32 if name == "top_k" else np.float32)
                    for name, values in columns.items()
                }
            )
        )


# How many of the most likely tokens a sampled step looks at first. Nothing sorts the vocabulary:
# measured on this 2-core CPU, V = 49152, XLA's sort takes 10 ms a row (more than SmolLM-135M's
# whole decode step), lax.top_k of 256 0.12 ms, of 1024 0.33 ms. Top-k ≤ 255, and a nucleus or a
# min-p floor that ends inside the 256, are cut there; a row whose cut falls further out finds it
# by bisection over the whole row (`_search`).
CANDIDATES = 256


def _search(scaled: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """Per row, the smallest value t of `scaled` [B, V] such that the values above t weigh less
    than `target` [B] (`weights` [B, V]). Bisection over float32's order read as uint32: 32 passes
    of one reduction each, exact, where a sort would cost 10 ms a row."""
    sign = jnp.uint32(0x80000000)
    bits = jax.lax.bitcast_convert_type(scaled, jnp.uint32)
    keys = jnp.where(bits >= sign, ~bits, bits | sign)  # ordered as the floats are

    def halve(_, bounds: tuple) -> tuple:
        lo, hi = bounds  # the values above lo weigh ≥ target, those above hi less
        mid = lo + (hi - lo) // 2
        light = jnp.sum(jnp.where(keys > mid[:, None], weights, 0.0), axis=-1) < target
        return jnp.where(light, lo, mid), jnp.where(light, mid, hi)

    lowest = jnp.min(keys, axis=-1) - 1  # above it: the whole row
    _, hi = jax.lax.fori_loop(0, 32, halve, (lowest, jnp.full_like(lowest, jnp.iinfo(jnp.uint32).max)))
    return jax.lax.bitcast_convert_type(jnp.where(hi >= sign, hi & ~sign, ~hi), jnp.float32)


def _logsumexp(x: jax.Array, top: jax.Array) -> jax.Array:
    """log Σ exp(x) per row [B], given each row's maximum `top` [B] (known here from top_k; and
    jax.nn.logsumexp's guards cost compile time in every program)."""
    return top + jnp.log(jnp.sum(jnp.exp(x - top[:, None]), axis=-1))


def _cut(ordered: jax.Array, k: jax.Array, top_p: jax.Array, lse_all: jax.Array) -> jax.Array:
    """The top-k, then top-p threshold [B] from the C most likely scaled logits `ordered` [B, C],
    descending; top-p's mass is normalised over the top-k set (all V when k > C: `lse_all`)."""
    C = ordered.shape[-1]
    top_p = jnp.where(top_p < 1, top_p, jnp.inf)  # off at 1, whatever the rounding of the mass
    ordered = jnp.where(jnp.arange(C) < k[:, None], ordered, -jnp.inf)
    lse = jnp.where(k <= C, _logsumexp(ordered, ordered[:, 0]), lse_all)
    probs = jnp.exp(ordered - lse[:, None])
    # Keep a token while the mass strictly before it is < top_p: the first one always stays. Never
    # past top-k: rounded below 1, the mass before a cut token would keep it (and undo top-k).
    kept = jnp.minimum(jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None], axis=-1), jnp.minimum(k, C))
    return jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)[:, 0]


def _draw(logits: jax.Array, keys: jax.Array, p: SamplerArrays) -> jax.Array:
    """A token per sampling row [B]: temperature, then the tokens at or above the row's threshold
    (top-k, top-p, min-p) drawn from in proportion to their probability.

    The threshold and the draw come from the row's top CANDIDATES when its cut lies inside them
    ("bounded"); otherwise from the whole vocabulary. Which path a row takes depends on its own
    logits and settings only, so a row's token never depends on its batch-mates."""
    B, V = logits.shape
    scaled = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    # The barrier keeps XLA CPU's TopK custom call: with slices such as ordered[:, -1] folded into
    # its output, XLA lowers top_k as a full sort again (measured: 10 ms against 0.12 ms, V = 49152).
    # One barrier per output: one over the pair crashes XLA's SPMD partitioner (jax 0.10.2, --devices > 1).
    ordered, index = map(jax.lax.optimization_barrier, jax.lax.top_k(scaled, min(V, CANDIDATES)))
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, V), V)
    filtered = (k < V) | (p.top_p < 1)  # top-p at 1 is off, as in transformers
    lse_all = _logsumexp(scaled, ordered[:, 0])
    # min-p: drop tokens less likely than min_p × the most likely one (log space).
    floor = jnp.where(p.min_p > 0, ordered[:, 0] + jnp.log(jnp.maximum(p.min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.where(filtered, _cut(ordered, k, p.top_p, lse_all), -jnp.inf), floor)
    bounded = (threshold > ordered[:, -1]) | (ordered.shape[-1] == V) | (p.temperature == 0)
    unsure = ~bounded & filtered  # the cut lies past the candidates: searched for in the whole row

    def searched_threshold() -> jax.Array:
        top_k = _search(scaled, jnp.ones_like(scaled), k.astype(jnp.float32))
        in_top_k = scaled >= top_k[:, None]
        lse = _logsumexp(jnp.where(in_top_k, scaled, -jnp.inf), ordered[:, 0])
        mass = jnp.where(in_top_k, jnp.exp(scaled - lse[:, None]), 0.0)
        top_p = jnp.where(p.top_p < 1, _search(scaled, mass, p.top_p), -jnp.inf)
        return jnp.where(unsure, jnp.maximum(jnp.maximum(top_k, top_p), floor), threshold)

    threshold = jax.lax.cond(jnp.any(unsure), searched_threshold, lambda: threshold)
    seeds = jax.random.key_data(keys)  # [B, 2] uint32
    near = jnp.take_along_axis(index, _gumbel_max(ordered, threshold, index, seeds)[:, None], axis=-1)[:, 0]

    def anywhere() -> jax.Array:
        return jnp.where(bounded, near, _gumbel_max(scaled, threshold, jnp.arange(V)[None, :], seeds))

    return jax.lax.cond(jnp.all(bounded), lambda: near, anywhere).astype(jnp.int32)


def _gumbel_max(x: jax.Array, threshold: jax.Array, ids: jax.Array, seeds: jax.Array) -> jax.Array:
    """Per row, the index of the token drawn from softmax(x) [B, N] over the values ≥ `threshold`
    [B] (Gumbel-max: the largest x + Gumbel noise). A token's noise is a function of the row's key
    and its id (`ids` [B, N] or [1, N]), not of where it sits, so two distributions sampled with
    the same key pick the same token unless they differ near it: a draft model drawing with the
    target's key makes the target's own token with probability ≥ (1 - TV) / (1 + TV), TV their total
    variation distance (Daliri et al. 2024, drafter-invariant speculative decoding). An inverse CDF
    over one shared uniform, the draw before this, agreed far less (0.36 against 0.80 at TV 0.16,
    `tests/test_sampling.py`): any shift in the mass before a token moves it. The noise is a hash
    (murmur3's finaliser, three rounds), not jax.random.gumbel, which measured 1.1 ms a row over
    49152 tokens and ~0.5 s of compile; this costs the same as the inverse CDF did."""
    h = ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    for word in (seeds[:, :1], seeds[:, 1:], seeds[:, :1]):
        h = _fmix32(h ^ word)
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return _argmax(jnp.where(x >= threshold[:, None], x - jnp.log(-jnp.log(u)), -jnp.inf))


def _fmix32(h: jax.Array) -> jax.Array:
    h ^= h >> 16
    h *= jnp.uint32(0x85EBCA6B)
    h ^= h >> 13
    h *= jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _argmax(logits: jax.Array) -> jax.Array:
    """The first most likely token per row, as jnp.argmax. Measured at V = 49152: 0.08 ms a row
    against argmax's 0.25 (at 16 rows 0.64 against 2.0): XLA CPU's variadic reduce is slow."""
    V = logits.shape[-1]
    first = jnp.min(jnp.where(logits == jnp.max(logits, axis=-1, keepdims=True), jnp.arange(V), V), axis=-1)
    return jnp.minimum(first, V - 1).astype(jnp.int32)  # NaN logits: the last id, still a valid one


@jax.tree_util.register_dataclass
@dataclass
class Penalties:
    """Where a state applies OpenAI's logit_bias and presence/frequency penalties (only those that
    ask carry it: a [B, V] read per step that other jobs do not pay): `bias` [B, V] float32 added
    to each row's logits, `counts` [B, V] int32 of each token among the row's generated ones."""

    bias: jax.Array
    counts: jax.Array

    @classmethod
    def zeros(cls, batch: int, vocab: int) -> Penalties:
        return cls(jnp.zeros((batch, vocab), jnp.float32), jnp.zeros((batch, vocab), jnp.int32))

    def apply(self, logits: jax.Array, p: SamplerArrays) -> jax.Array:
        """logits [B, n] (the first n ids) with the bias added and the penalties subtracted (OpenAI's
        rule: frequency × count + presence × [count > 0])."""
        n = logits.shape[1]
        counts = self.counts[:, :n].astype(jnp.float32)
        penalty = p.frequency_penalty[:, None] * counts + p.presence_penalty[:, None] * (counts > 0)
        return logits + self.bias[:, :n] - penalty


# A row's `Guards.left` outside a thinking block: more tokens than any context holds
UNBOUNDED = 2**30


@jax.tree_util.register_dataclass
@dataclass
class Guards:
    """Where a state bars or forces tokens by a row's own count (only states that ask carry it):
    - `floor` [B] int32: below this position the row samples no EOS id (vLLM's `min_tokens`);
    - `budget` [B] int32: the tokens a thinking block of the row may hold (UNBOUNDED: no budget);
    - `left` [B] int32: those it may still write in the block it is in (UNBOUNDED outside one);
      at 0 and below, its end is forced a token at a time: `forced[-left]` (llama.cpp's
      `--reasoning-budget N`);
    - `opener` [O], `closer` [C]: the markers that open and close a block (the row's last tokens
      matching one starts or ends its count); `forced` [F]: what ends a block at its budget (a
      message, then the closer)."""

    ROWS = ("floor", "budget", "left")  # the per-row fields, in `rows`' order

    floor: jax.Array
    budget: jax.Array
    left: jax.Array
    opener: jax.Array
    closer: jax.Array
    forced: jax.Array

    @classmethod
    def zeros(cls, batch: int, markers: tuple[tuple[int, ...], ...]) -> Guards:
        """No row guarded; `markers` the (opener, closer, forced) token ids (empty: -1, never made)."""
        ids = [np.asarray(m or (-1,), np.int32) for m in markers]
        return cls(*(np.full(batch, v, np.int32) for v in (0, UNBOUNDED, UNBOUNDED)), *ids)

    @staticmethod
    def rows(rows: list[tuple[int, int, bool]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(floor, budget, left) [R] of rows admitted as (floor, budget or -1, opened by the prompt)."""
        budget = [UNBOUNDED if b < 0 else b for _, b, _ in rows]
        left = [b if opened else UNBOUNDED for b, (*_, opened) in zip(budget, rows)]
        return tuple(np.asarray(x, np.int32) for x in ([f for f, *_ in rows], budget, left))

    def per_row(self, change) -> Guards:
        """The per-row fields (floor, budget, left) as `change(name, array)` gives them."""
        return replace(self, **{name: change(name, getattr(self, name)) for name in self.ROWS})

    def apply(self, logits: jax.Array, position: jax.Array, eos: jax.Array) -> jax.Array:
        """logits [B, n] of tokens for `position` [B]: a row forced to end its block may take only the
        next forced token, a row below its floor no EOS id."""
        ids = jnp.arange(logits.shape[1])
        next_forced = self.forced[jnp.clip(-self.left, 0, self.forced.shape[0] - 1)]
        logits = jnp.where((self.left <= 0)[:, None] & (ids != next_forced[:, None]), -jnp.inf, logits)
        return jnp.where((position < self.floor)[:, None] & jnp.isin(ids, eos)[None], -jnp.inf, logits)

    def advance(self, tokens: jax.Array, length: jax.Array, made: jax.Array) -> Guards:
        """After rows made `made` [B] tokens, now `length` [B] long (`tokens` [B, S] every row's): a
        forced token moves the forcing on (the last ends it), a row whose tokens end in the opener
        starts counting its budget, in the closer stops, and any other token counts one down. A
        guarded row makes one token a step (it drafts nothing)."""

        def ends_in(marker: jax.Array) -> jax.Array:
            at = jnp.maximum(length[:, None] - marker.shape[0] + jnp.arange(marker.shape[0]), 0)
            return jnp.all(jnp.take_along_axis(tokens, at, axis=1) == marker, axis=1) & (length >= marker.shape[0])

        forcing = jnp.where(-self.left >= self.forced.shape[0] - 1, UNBOUNDED, self.left - 1)
        closed = jnp.where(ends_in(self.closer), UNBOUNDED, self.left - made)
        counted = jnp.where(ends_in(self.opener), self.budget, closed)
        left = jnp.where(made == 0, self.left, jnp.where(self.left <= 0, forcing, counted))
        return replace(self, left=left)


def _penalized(logits: jax.Array, seen: jax.Array, p: SamplerArrays) -> jax.Array:
    """The repetition penalty (transformers' rule): the tokens `seen` [B, V] made less likely."""
    penalty = p.repeat_penalty[:, None]
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits: jax.Array, seen: jax.Array, keys: jax.Array, p: SamplerArrays) -> jax.Array:
    """Next tokens [B] from float32 logits [B, V]; `seen` [B, V] marks tokens for the repetition
    penalty; `keys` [B] are this position's PRNG keys, one per row."""
    logits = _penalized(logits, seen, p)
    greedy = _argmax(logits)
    sampled = lambda: jnp.where(p.temperature > 0, _draw(logits, keys, p), greedy)  # noqa: E731
    return jax.lax.cond(jnp.all(p.temperature == 0), lambda: greedy, sampled)


# Alternatives recorded at each position where log-probabilities are asked for: the most OpenAI's
# API returns (`top_logprobs` ≤ 20). Fixed, so asking for fewer never compiles another program.
TOP_LOGPROBS = 20


def check_logprobs(n: int | None) -> None:
    """`logprobs`: None (off), or how many alternatives to give beside each token (0 to TOP_LOGPROBS)."""
    if n is not None and not (_whole(n) and 0 <= n <= TOP_LOGPROBS):
        raise JaxinferError(
            f"logprobs must be a whole number from 0 to {TOP_LOGPROBS} (alternatives per token)", "logprobs"
        )


def check_logit_bias(bias: dict[int, float] | None, vocab: int) -> None:
    """`logit_bias`: token ids of the vocabulary (0 to `vocab` - 1), each with a finite bias or
    -inf (never sampled)."""
    for token, value in (bias or {}).items():
        if not (_whole(token) and 0 <= token < vocab):
            raise JaxinferError(
                f"logit_bias: {token!r} is not a token id of this model (0 to {vocab - 1})", "logit_bias"
            )
        if not (math.isfinite(value) or value == -math.inf):
            raise JaxinferError(f"logit_bias: the bias of token {token} must be a number or -inf", "logit_bias")


def logprobs(
    logits: jax.Array, seen: jax.Array, p: SamplerArrays, token: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the distribution each row's token is drawn from: the logits [B, V]
    after the repetition penalty and the temperature (1 for a greedy row: the model's own), before
    top-k, top-p and min-p cut it (a cut only renormalises what it keeps). Returns the chosen
    `token`'s [B], and the TOP_LOGPROBS most likely ids [B, N] with theirs [B, N]."""
    scaled = _penalized(logits, seen, p) / jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    # one barrier per output, as in `_draw`: XLA CPU keeps its TopK custom call instead of a full sort
    top, ids = map(jax.lax.optimization_barrier, jax.lax.top_k(scaled, min(TOP_LOGPROBS, scaled.shape[-1])))
    lse = _logsumexp(scaled, top[:, 0])
    chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0] - lse
    return chosen, ids.astype(jnp.int32), top - lse[:, None]


def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
