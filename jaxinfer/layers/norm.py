"""The RMSNorm every part of a layer takes its input (and, in Gemma's sandwich, its output) through."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig


def rms_norm(x: jax.Array, weight: jax.Array, cfg: ModelConfig) -> jax.Array:
    """As transformers: normalise in float32, cast back, then scale (Llama); Gemma scales by
    (1 + weight) in float32 before the cast."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    if weight is None:  # a norm without a scale (Gemma 4's of the values)
        return x32.astype(x.dtype)
    if cfg.norm_plus_one:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)
