"""Block-quantized weights: int8 (q8_0-like) and int4 (q4_0-like), blocks of 32 along the input.

A quantized matrix is a dict `{"q", "scale"}` in the parameter tree where a float [out, in] matrix
would be, packed as the CPU kernel (`kernels/matmul.cc`) reads it: 16 outputs side by side.

- int8: per block of 32, scale d = max|w| / 127 (stored bfloat16), q = round(w / d) in [-127, 127].
- int4: as llama.cpp's q4_0, d = w* / -8 where w* is the block's value of largest magnitude, and
  q = round(w / d) + 8 clipped to [0, 15], two to a byte.

Decode reads every weight once per step, so bytes are its speed: int8 is 34 bytes per 32 weights
(3.8× fewer than float32), int4 18. The matmul runs on our FFI kernel where it is built (the CPU;
W8A8 as llama.cpp's, `matmul`) and otherwise dequantizes in the graph (GPUs fuse that into the dot).
A matrix whose dimensions do not divide into 16 outputs by 32 inputs stays float.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer import kernel
from jaxinfer.errors import JaxinferError

METHODS = ("int8", "int4")
BLOCK, GROUP = 32, 16


def quantizable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[0] % GROUP == 0 and shape[1] % BLOCK == 0


def check_method(method: str | None) -> str | None:
    if method is not None and method not in METHODS:
        raise JaxinferError(f"--quantize must be one of {', '.join(METHODS)}, not {method!r}")
    return method


def is_quantized(leaf) -> bool:
    return isinstance(leaf, dict) and "q" in leaf


def method_of(leaf) -> str:
    return "int8" if leaf["q"].dtype == jnp.int8 else "int4"


def packed_shapes(shape: tuple[int, int], method: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """The packed leaves of an [out, in] matrix: name → (shape, dtype)."""
    groups, blocks = shape[0] // GROUP, shape[1] // BLOCK
    chunks, dtype = (8, jnp.int8) if method == "int8" else (4, jnp.uint8)
    return {"q": ((groups, blocks, chunks, GROUP, 4), dtype), "scale": ((groups, blocks, GROUP), jnp.bfloat16)}


@functools.partial(jax.jit, static_argnames="method")
def quantize(w: jax.Array, method: str) -> dict:
    """[out, in] float → the packed dict."""
    n, k = w.shape
    blocks = w.astype(jnp.float32).reshape(n, k // BLOCK, BLOCK)
    if method == "int8":
        scale = (jnp.abs(blocks).max(-1) / 127).astype(jnp.bfloat16)
        d = scale.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(blocks / jnp.where(d == 0, 1, d)), -127, 127).astype(jnp.int8)
    else:
        at = jnp.argmax(jnp.abs(blocks), -1)[..., None]
        scale = (jnp.take_along_axis(blocks, at, -1)[..., 0] / -8).astype(jnp.bfloat16)
        d = scale.astype(jnp.float32)[..., None]
        q = jnp.clip(jnp.round(blocks / jnp.where(d == 0, 1, d)) + 8, 0, 15).astype(jnp.uint8)
    # [n, k/32, 32] → [n/16, k/32, 8, 16, 4]: chunk c of 4 k, then 16 outputs
    q = q.reshape(n // GROUP, GROUP, k // BLOCK, 8, 4).transpose(0, 2, 3, 1, 4)
    if method == "int4":  # chunks c and c + 4 share a byte, low and high nibble
        q = q[:, :, :4] | (q[:, :, 4:] << 4)
    scale = scale.reshape(n // GROUP, GROUP, k // BLOCK).transpose(0, 2, 1)
    return {"q": q, "scale": scale}


def _values(q: jax.Array) -> jax.Array:
    """Packed q → signed integer values [n/16, k/32, 8, 16, 4] (int32)."""
    if q.dtype == jnp.int8:
        return q.astype(jnp.int32)
    wide = q.astype(jnp.int32)
    return jnp.concatenate([wide & 0x0F, wide >> 4], axis=-3) - 8


def dequantize(leaf: dict, dtype=jnp.float32) -> jax.Array:
    """The packed dict → [out, in] in `dtype`."""
    values = _values(leaf["q"])
    groups, blocks = values.shape[:2]
    w = values.astype(jnp.float32) * leaf["scale"].astype(jnp.float32)[:, :, None, :, None]
    return w.transpose(0, 3, 1, 2, 4).reshape(groups * GROUP, blocks * BLOCK).astype(dtype)


def take_rows(leaf: dict, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the [out, in] matrix, dequantized (the embedding lookup)."""
    values = _values(leaf["q"][ids // GROUP])  # [..., k/32, 8, 16, 4]
    lane = (ids % GROUP)[..., None, None, None, None]
    values = jnp.take_along_axis(values, jnp.broadcast_to(lane, (*values.shape[:-2], 1, 4)), -2)[..., 0, :]
    scale = jnp.take_along_axis(leaf["scale"][ids // GROUP], (ids % GROUP)[..., None, None], -1)  # [..., k/32, 1]
    rows = values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]  # [..., k/32, 8, 4]
    return rows.reshape(*ids.shape, -1).astype(dtype)


def matmul(x: jax.Array, leaf: dict) -> jax.Array:
    """x [..., in] @ W.T → [..., out] float32: the kernel where built for this backend, else the
    dequantized weight in the graph."""
    if kernel.available():
        return kernel.call("jaxinfer_qmatmul", x, leaf["q"].shape[0] * GROUP, leaf["q"], leaf["scale"])
    return jnp.einsum("...i,oi->...o", x, dequantize(leaf, x.dtype), preferred_element_type=jnp.float32)


def w8a8_reference(x: jax.Array, leaf: dict) -> jax.Array:
    """What the kernel computes, in jnp: x quantized to int8 per block, integer dots per block,
    then scaled and summed in float32 (the test oracle for the kernel's arithmetic)."""
    w = _values(leaf["q"])
    groups, blocks = w.shape[:2]
    w = w.transpose(0, 3, 1, 2, 4).reshape(groups * GROUP, blocks, BLOCK)
    xb = x.astype(jnp.float32).reshape(-1, blocks, BLOCK)
    amax = jnp.abs(xb).max(-1)
    xq = jnp.round(xb * jnp.where(amax > 0, 127 / jnp.where(amax > 0, amax, 1), 0)[..., None]).astype(jnp.int32)
    dots = jnp.einsum("mbk,nbk->mnb", xq, w)  # exact in int32
    scale = leaf["scale"].astype(jnp.float32).transpose(0, 2, 1).reshape(groups * GROUP, blocks)
    out = (dots.astype(jnp.float32) * scale[None] * (amax / 127)[:, None, :]).sum(-1)
    return out.reshape(*x.shape[:-1], groups * GROUP)
