"""Gemma 3n's residual stream (transformers' `Gemma3nTextAltUp`, `Gemma3nTextLaurelBlock`): AltUp keeps
`altup_inputs` streams [A, N, D] of which each layer runs on one (its attention and MLP) and then
corrects the others from what that one became, each stream mixed by coefficients a small router
reads off the active stream; LAuReL adds a low-rank residual beside attention. The first stream is
the embedding, the others its projections rescaled to its magnitude; at the end the others are
projected back, rescaled, and the streams averaged.

Leaves: the model's "altup_in_j" and "altup_out_j" [D, D] (j = 1 .. A-1, plain arrays: never
quantized, a few percent of the weights); each layer's "altup_router" [A, D], "altup_router_norm"
[D], "altup_predict" [A², A], "altup_correct" [A, A], "altup_scale" [D], and the LAuReL matrices
"wlaurel_left" [R, D], "wlaurel_right" [D, R] with its norm "laurel_norm" [D]."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.layers.feed_forward import linear
from jaxinfer.layers.norm import rms_norm


def _rescaled(x: jax.Array, target: jax.Array) -> jax.Array:
    """x with the RMS magnitude `target` [N, 1] (its own floored at 1e-5 in the square)."""
    own = jnp.sqrt(jnp.maximum(jnp.mean(x * x, axis=-1, keepdims=True), 1e-5))
    return x * target / own


def _magnitude(x: jax.Array) -> jax.Array:
    return jnp.mean(x * x, axis=-1, keepdims=True) ** 0.5


def spread(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The embeddings x [N, D] as the A streams [A, N, D]."""
    target = _magnitude(x)
    others = [_rescaled(x @ params[f"altup_in_{j}"].T.astype(x.dtype), target) for j in range(1, cfg.altup_inputs)]
    return jnp.stack([x, *others])


def gather(params: dict, xs: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The streams [A, N, D] back into one [N, D]: the others projected back and rescaled to the
    first's magnitude, then all averaged."""
    target = _magnitude(xs[0])
    others = [
        _rescaled(xs[j] @ params[f"altup_out_{j}"].T.astype(xs.dtype), target) for j in range(1, cfg.altup_inputs)
    ]
    return jnp.mean(jnp.stack([xs[0], *others]), axis=0)


def _modalities(layer: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The router's reading of the active stream x [N, D]: [N, A] in (-1, 1)."""
    routed = rms_norm(x, layer["altup_router_norm"], cfg) * jnp.asarray(cfg.hidden_size**-1.0, x.dtype)
    return jnp.tanh((routed @ layer["altup_router"].T.astype(x.dtype)).astype(jnp.float32)).astype(x.dtype)


def predict(layer: dict, xs: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Each stream's prediction of the layer's output [A, N, D]: the streams plus a mix of all of them
    by coefficients of the active stream's modalities."""
    A = cfg.altup_inputs
    modalities = _modalities(layer, xs[cfg.altup_active], cfg)
    coefs = (modalities @ layer["altup_predict"].T.astype(xs.dtype)).reshape(-1, A, A)  # [N, i, j]
    return xs + jnp.einsum("jnd,nij->ind", xs, coefs).astype(xs.dtype)


def correct(layer: dict, predictions: jax.Array, activated: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The predictions [A, N, D] corrected by what the active stream became (`activated` [N, D]):
    each plus its own multiple of the active one's innovation."""
    modalities = _modalities(layer, activated, cfg)
    coefs = modalities @ layer["altup_correct"].T.astype(activated.dtype) + 1.0  # [N, A]
    innovation = activated - predictions[cfg.altup_active]
    return predictions + coefs.T[:, :, None] * innovation[None]


def laurel(layer: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """LAuReL on the normed active stream x [N, D]: x plus its low-rank map, normed."""
    return x + rms_norm(
        linear(linear(x, layer, "laurel_left", cfg), layer, "laurel_right", cfg), layer["laurel_norm"], cfg
    )
