"""Token sampling: user-facing settings on the host, and a pure sampler over per-row traced arrays.

Every knob reaches the compiled code as an array ([B] per field), so changing --temp, --top-p, ...
never recompiles. The order of the transforms follows transformers: repetition penalty, then
temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import JaxinferError


@dataclass(frozen=True)
class Sampling:
    """What the user asked for. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 and
    repeat_penalty 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Named as a batch line's field and as the flag; NaN fails every comparison.
        checks = (
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature (--temp) must be ≥ 0 (0 is greedy)"),
            (_whole(self.top_k) and self.top_k >= 0, "top_k (--top-k) must be a whole number ≥ 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p (--top-p) must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p (--min-p) must be in [0, 1)"),
            (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0, "repeat_penalty (--repeat-penalty) must be > 0 (1 turns it off)"),
        )
        for ok, message in checks:
            if not ok:
                raise JaxinferError(message)

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

    @classmethod
    def from_settings(cls, rows: list[Sampling]) -> SamplerArrays:
        columns = {f.name: [getattr(r, f.name) for r in rows] for f in fields(Sampling)}
        columns["top_k"] = [min(k, 2**31 - 1) for k in columns["top_k"]]  # int32; any k ≥ the vocabulary is off
        # numpy, then one device_put: building on the device would dispatch a conversion program
        return jax.device_put(cls(**{name: np.asarray(values, np.int32 if name == "top_k" else np.float32) for name, values in columns.items()}))


def _filter(logits: jax.Array, p: SamplerArrays) -> jax.Array:
    """Temperature, then top-k, top-p and min-p as -inf masks over logits [B, V]."""
    V = logits.shape[-1]
    logits = logits / jnp.maximum(p.temperature, 1e-6)[:, None]
    ordered = -jnp.sort(-logits, axis=-1)  # [B, V] descending
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, V), V)  # [B]
    ordered = jnp.where(jnp.arange(V) < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep a token while the mass strictly before it is < top_p: the first one always stays. Never
    # past top-k: rounded below 1, the mass before a cut token would keep it (and undo top-k).
    kept = jnp.minimum(jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < p.top_p[:, None], axis=-1), k)  # [B] ≥ 1
    threshold = jnp.take_along_axis(ordered, (kept - 1)[:, None], axis=-1)  # [B, 1]
    # min-p: drop tokens less likely than min_p × the most likely one (log space).
    min_p_floor = jnp.where(p.min_p > 0, ordered[:, 0] + jnp.log(jnp.maximum(p.min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(threshold, min_p_floor[:, None])
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: jax.Array, seen: jax.Array, keys: jax.Array, p: SamplerArrays) -> jax.Array:
    """Next tokens [B] from float32 logits [B, V]; `seen` [B, V] marks tokens for the repetition
    penalty; `keys` [B] are this position's PRNG keys, one per row."""
    penalty = p.repeat_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled() -> jax.Array:
        drawn = jax.vmap(jax.random.categorical)(keys, _filter(logits, p)).astype(jnp.int32)
        return jnp.where(p.temperature > 0, drawn, greedy)

    # The sort in the filters costs more than a small model's whole step: skip it when all rows are greedy.
    return jax.lax.cond(jnp.all(p.temperature == 0), lambda: greedy, sampled)


def _whole(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
