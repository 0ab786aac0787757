"""Float weight matrices packed for the CPU kernel (`kernels/matmul.cc`, `jaxinfer_fmatmul`): an
[out, in] matrix is stored with 16 outputs side by side (`forms.Packed`), float32 as [out/16, in, 16]
and bfloat16 as [out/16, in/2, 16, 2], each output's pair of consecutive inputs
together: the layout of AMX's bfloat16 tiles, which prefill chunks run on where the CPU has them
(repacking per call cost about half of a 128-row chunk's matmul time).

XLA CPU's dot runs 2–16 rows at a third to a half of its matrix-vector rate (speculation's verify
pass, batched decode, chunked prefill) and converts bfloat16 weights to float32 on every call. The
kernel reads each weight once for all rows, in its stored width. Measured by
`python scripts/bench_matmul.py` (SmolLM-135M's LM head, 49152×576, ms, XLA's best layout → kernel):
float32 1 row 3.95 → 3.88, 5 rows 6.6 → 4.0, 16 rows 11.0 → 5.9, 128 rows 41 → 38; bfloat16 weights
1 row 45 → 2.5.

The load packs every float32 or bfloat16 matrix whose out dimension divides by 16, and a bfloat16 one's
in dimension by 2 (`forms.lay_out`); the rest stay [out, in]. Where the kernel is not built, the packed
form still works, on XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import kernel

GROUP = 16


def packable(w: jax.Array) -> bool:
    """A float32 matrix of whole groups, or a bfloat16 one of whole groups and pairs (float16 stays
    on XLA's dot)."""
    if not (w.ndim == 2 and w.shape[0] % GROUP == 0):
        return False
    return w.dtype == jnp.float32 or (w.dtype == jnp.bfloat16 and w.shape[1] % 2 == 0)


def pack(w: jax.Array) -> jax.Array:
    """[out, in] → [out/16, in, 16] (float32) or [out/16, in/2, 16, 2] (bfloat16)."""
    n, k = w.shape
    if w.dtype == jnp.bfloat16:
        return w.reshape(n // GROUP, GROUP, k // 2, 2).transpose(0, 2, 1, 3)
    return w.reshape(n // GROUP, GROUP, k).transpose(0, 2, 1)


def _paired(w: jax.Array) -> jax.Array:
    """Either layout as [out/16, in/pairs, 16, pair] (a pair of 1 for float32)."""
    return w if w.ndim == 4 else w[..., None]


def unpack(w: jax.Array) -> jax.Array:
    """The [out, in] matrix again."""
    w = _paired(w)
    groups, steps, _, pair = w.shape
    return w.transpose(0, 2, 1, 3).reshape(groups * GROUP, steps * pair)


def bf16_values(x: jax.Array) -> jax.Array:
    """x rounded to bfloat16 (to nearest even), kept in its own dtype."""
    return x.astype(jnp.bfloat16).astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, bf16_inputs: bool = False, experts: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ W.T → float32 [..., out] for packed w: on the kernel where it is built for this
    backend. `bf16_inputs`: x rounded to bfloat16 first (`ModelConfig.matmul_inputs`; in the kernel,
    where it costs nothing: in the graph, XLA CPU ran the rounding as 91 fusions of their own, 18 ms
    of a 190 ms SmolLM-135M prompt of 512 tokens). `experts` (the kernel's only): w is a stack of
    experts' matrices, and row r of x [R, in] multiplies by matrix experts[r]."""
    if kernel.available():
        groups = w.shape[0 if experts is None else 1]
        return kernel.call("jaxinfer_fmatmul", x, groups * GROUP, w, experts=experts, bf16_inputs=bf16_inputs)
    if experts is not None:
        raise ValueError("routed rows are the CPU kernel's")
    if bf16_inputs:
        x = bf16_values(x)
    w = _paired(w)
    pairs = x.reshape(*x.shape[:-1], w.shape[1], w.shape[3])
    y = jnp.einsum("...kj,gknj->...gn", pairs, w, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], w.shape[0] * GROUP)


def take_rows(w: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the packed [out, in] matrix (the embedding lookup): [..., in]."""
    w = _paired(w)
    if w.dtype != jnp.bfloat16:
        rows = w[ids // GROUP, :, ids % GROUP]  # [..., in/pairs, pair]
        return rows.reshape(*rows.shape[:-2], -1).astype(dtype)
    # bfloat16 rows gathered as their bits and widened by a shift: XLA CPU gathers bfloat16 in
    # float32, so it widened the whole embedding, hoisted out of the decode loop, once per decode
    # call (333 ms for TinyLlama's 32000×2048, measured in a profile)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16)[ids // GROUP, :, ids % GROUP]
    bits = bits.reshape(*bits.shape[:-2], -1).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)
