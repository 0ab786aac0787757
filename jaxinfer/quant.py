"""Block-quantized weights: the methods' registry, blocks of 32 along the input. int8 (q8_0-like) and
int4 (q4_0-like) are ours, with bfloat16 scales; q8_0 and q4_0 are llama.cpp's, bit for bit (float16
scales, its rounding), so a GGUF file's Q8_0/Q4_0 tensors run as the file holds them.

A quantized matrix (`forms.Quantized`) holds `q` and `scale` packed as the CPU kernel
(`kernels/matmul.cc`) reads them: per group of 16 outputs and block of 32 inputs, chunks of 4 inputs
with the 16 outputs side by side.

- int8: per block of 32, scale d = max|w| / 127 (stored bfloat16), q = round(w / d) in [-127, 127].
- int4: as llama.cpp's q4_0, d = w* / -8 where w* is the block's value of largest magnitude, and
  q = round(w / d) + 8 clipped to [0, 15], two to a byte (chunks c and c + 4 share one).
- q8_0, q4_0: llama.cpp's `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`: the codes from the
  float32 scale's reciprocal, the scale stored float16 (exact for what a GGUF file holds).

Decode reads every weight once per step, so bytes are its speed: int8 is 34 bytes per 32 weights
(3.8× fewer than float32), int4 18. The matmul runs on our FFI kernel where it is built (the CPU;
W8A8 as llama.cpp's, `matmul`) and otherwise dequantizes in the graph (GPUs fuse that into the dot).
A matrix whose dimensions do not divide into 16 outputs by 32 inputs stays float.

A method is one `Method` entry in `METHODS`: its bits, scale dtype, packed shapes, quantize and
integer values; the kernel tells 8 from 4 bits by q's dtype and the scales' width by theirs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from jaxinfer import kernel
from jaxinfer.errors import JaxinferError

BLOCK, GROUP = 32, 16


def _int8_codes(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Blocks [n, k/32, 32] float32 → (codes [n, k/32, 32] int8, scales [n, k/32] bfloat16)."""
    scale = (jnp.abs(blocks).max(-1) / 127).astype(jnp.bfloat16)
    d = scale.astype(jnp.float32)[..., None]
    return jnp.clip(jnp.round(blocks / jnp.where(d == 0, 1, d)), -127, 127).astype(jnp.int8), scale


def _int4_codes(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """As `_int8_codes`, codes q + 8 in [0, 15] (uint8, one per byte until packed)."""
    at = jnp.argmax(jnp.abs(blocks), -1)[..., None]
    scale = (jnp.take_along_axis(blocks, at, -1)[..., 0] / -8).astype(jnp.bfloat16)
    d = scale.astype(jnp.float32)[..., None]
    return jnp.clip(jnp.round(blocks / jnp.where(d == 0, 1, d)) + 8, 0, 15).astype(jnp.uint8), scale


def _q8_0_codes(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """llama.cpp's q8_0: d = max|w| / 127, codes roundf(w · (1/d)) (half away from zero), d stored float16."""
    d = jnp.abs(blocks).max(-1, keepdims=True) / 127
    inverse = jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d))
    scaled = blocks * inverse
    codes = jnp.sign(scaled) * jnp.floor(jnp.abs(scaled) + 0.5)
    return codes.astype(jnp.int8), d[..., 0].astype(jnp.float16)


def _q4_0_codes(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """llama.cpp's q4_0: d = w* / -8 (w*: the value of largest magnitude), codes min(15, ⌊w · (1/d) + 8.5⌋)."""
    at = jnp.argmax(jnp.abs(blocks), -1)[..., None]
    d = jnp.take_along_axis(blocks, at, -1) / -8
    inverse = jnp.where(d == 0, 0, 1 / jnp.where(d == 0, 1, d))
    codes = jnp.minimum(15, jnp.floor(blocks * inverse + 8.5))
    return codes.astype(jnp.uint8), d[..., 0].astype(jnp.float16)


@dataclass(frozen=True)
class Method:
    """A block quantization the kernel reads: `codes` makes a block's integer codes and scales, and
    the packing keeps `chunks` chunks of 4 inputs a block (int4: two codes a byte)."""

    name: str
    bits: int
    dtype: object  # q's
    codes: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    scale_dtype: object = jnp.bfloat16

    @property
    def chunks(self) -> int:
        """Chunks of 4 inputs stored per block: 8, halved where two codes share a byte."""
        return 8 * self.bits // 8

    @property
    def bytes_per_value(self) -> float:
        """Codes and a 16-bit scale per block of 32."""
        return (BLOCK * self.bits / 8 + 2) / BLOCK

    def packed_shapes(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], object]]:
        """The packed leaves of an [out, in] matrix: name → (shape, dtype)."""
        groups, blocks = shape[0] // GROUP, shape[1] // BLOCK
        return {
            "q": ((groups, blocks, self.chunks, GROUP, 4), self.dtype),
            "scale": ((groups, blocks, GROUP), self.scale_dtype),
        }

    def values(self, q: jax.Array) -> jax.Array:
        """Packed q → signed integer values [n/16, k/32, 8, 16, 4] (int32)."""
        wide = q.astype(jnp.int32)
        if self.bits == 8:
            return wide
        return jnp.concatenate([wide & 0x0F, wide >> 4], axis=-3) - 8


METHODS = {
    m.name: m
    for m in (
        Method("int8", 8, jnp.int8, _int8_codes),
        Method("int4", 4, jnp.uint8, _int4_codes),
        Method("q8_0", 8, jnp.int8, _q8_0_codes, jnp.float16),
        Method("q4_0", 4, jnp.uint8, _q4_0_codes, jnp.float16),
    )
}


def check_method(method: str | None) -> str | None:
    if method is not None and method not in METHODS:
        raise JaxinferError(f"quantize must be one of {', '.join(METHODS)}, not {method!r}", "quantize")
    return method


def quantizable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[0] % GROUP == 0 and shape[1] % BLOCK == 0


@functools.partial(jax.jit, static_argnames="method")
def quantize(w: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    """[out, in] float → (q, scale) packed."""
    n, k = w.shape
    return pack(*METHODS[method].codes(w.astype(jnp.float32).reshape(n, k // BLOCK, BLOCK)), method)


@functools.partial(jax.jit, static_argnames="method")
def pack(codes: jax.Array, scale: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    """Codes [n, k/32, 32] (4 bits: q + 8, one a byte) and scales [n, k/32] → (q, scale) as the kernel
    reads them."""
    n, blocks = scale.shape
    # [n, k/32, 32] → [n/16, k/32, 8, 16, 4]: chunk c of 4 k, then 16 outputs
    q = codes.astype(METHODS[method].dtype).reshape(n // GROUP, GROUP, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    if METHODS[method].bits == 4:  # chunks c and c + 4 share a byte, low and high nibble
        q = q[:, :, :4] | (q[:, :, 4:] << 4)
    return q, scale.astype(METHODS[method].scale_dtype).reshape(n // GROUP, GROUP, blocks).transpose(0, 2, 1)


def dequantize(q: jax.Array, scale: jax.Array, method: str, dtype=jnp.float32) -> jax.Array:
    """The packed matrix → [out, in] in `dtype`."""
    values = METHODS[method].values(q)
    groups, blocks = values.shape[:2]
    w = values.astype(jnp.float32) * scale.astype(jnp.float32)[:, :, None, :, None]
    return w.transpose(0, 3, 1, 2, 4).reshape(groups * GROUP, blocks * BLOCK).astype(dtype)


def take_rows(q: jax.Array, scale: jax.Array, method: str, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the [out, in] matrix, dequantized (the embedding lookup)."""
    values = METHODS[method].values(q[ids // GROUP])  # [..., k/32, 8, 16, 4]
    lane = (ids % GROUP)[..., None, None, None, None]
    values = jnp.take_along_axis(values, jnp.broadcast_to(lane, (*values.shape[:-2], 1, 4)), -2)[..., 0, :]
    scale = jnp.take_along_axis(scale[ids // GROUP], (ids % GROUP)[..., None, None], -1)  # [..., k/32, 1]
    rows = values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]  # [..., k/32, 8, 4]
    return rows.reshape(*ids.shape, -1).astype(dtype)


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array, method: str) -> jax.Array:
    """x [..., in] @ W.T → [..., out] float32: the kernel where built for this backend, else the
    dequantized weight in the graph."""
    if kernel.available():
        return kernel.call("jaxinfer_qmatmul", x, q.shape[0] * GROUP, q, scale)
    return jnp.einsum("...i,oi->...o", x, dequantize(q, scale, method, x.dtype), preferred_element_type=jnp.float32)


def w8a8_reference(x: jax.Array, q: jax.Array, scale: jax.Array, method: str) -> jax.Array:
    """What the kernel computes, in jnp: x quantized to int8 per block, integer dots per block,
    then scaled and summed in float32 (the test oracle for the kernel's arithmetic)."""
    w = METHODS[method].values(q)
    groups, blocks = w.shape[:2]
    w = w.transpose(0, 3, 1, 2, 4).reshape(groups * GROUP, blocks, BLOCK)
    xb = x.astype(jnp.float32).reshape(-1, blocks, BLOCK)
    amax = jnp.abs(xb).max(-1)
    xq = jnp.round(xb * jnp.where(amax > 0, 127 / jnp.where(amax > 0, amax, 1), 0)[..., None]).astype(jnp.int32)
    dots = jnp.einsum("mbk,nbk->mnb", xq, w)  # exact in int32
    scale = scale.astype(jnp.float32).transpose(0, 2, 1).reshape(groups * GROUP, blocks)
    out = (dots.astype(jnp.float32) * scale[None] * (amax / 127)[:, None, :]).sum(-1)
    return out.reshape(*x.shape[:-1], groups * GROUP)
