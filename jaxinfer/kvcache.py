"""The preallocated, fixed-shape KV cache: one stacked array per K and V, passed in and returned.

Its shape never changes, so decode compiles once per cache size; every jit that returns it donates it,
so XLA updates it in place instead of copying gigabytes per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KV, hd]
    v: jax.Array  # [L, B, S, KV, hd]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
        shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def write(
        self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array, rows: jax.Array | None = None
    ) -> KVCache:
        """Store k, v [R, T, KV, hd] at `positions` [R, T] of cache rows `rows` [R] (default: the
        first R) in `layer`; positions ≥ S are dropped.

        A scatter into the whole stacked array (not `cache[layer]` then `.at[layer].set`), so XLA
        keeps the update in place.
        """
        rows = (jnp.arange(k.shape[0]) if rows is None else rows)[:, None]  # [R, 1]
        return KVCache(
            k=self.k.at[layer, rows, positions].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, rows, positions].set(v.astype(self.v.dtype), mode="drop"),
        )
