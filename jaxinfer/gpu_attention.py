"""Decode's attention on a GPU: each row's one query over the cache where it lies, up to the row's
own position (not the whole kv bucket), split over the keys so that a batch of one still fills the
GPU (flash-decoding's split-K); an int8 cache read as stored. A Pallas kernel, lowered through Triton.

Through XLA a decode step's attention ran as several kernels a layer over the whole bucket (scores,
mask, max, exp, sums, the value product: the 1B shape's step was 389 kernels, ~40% of its time in
small ones; BENCHMARKS.md, "On a GPU"), and a bucket holds up to twice the positions a row has
written. Here one program takes one row, one kv head and one share of the bucket's keys: it holds
the kv head's G query heads (padded to `HEADS`, Triton's dot takes 16 rows at least) and walks its
share `BLOCK_K` keys at a time with the running softmax, visiting only the blocks between the row's
first visible key (a sliding window's) and its position; shares past the position do nothing.
XLA then merges the shares' (max, sum, weighted values), one small fusion. int8 K/V are converted in
registers, their per-position scales multiplying the scores (K) and the weights (V), as the XLA path
does (`model._attend`).

Which caches take it: `KVCache.zeros` says once, per cache (`here`): a GPU (or `gpu.MODE`
"interpret", where the CPU tests run the same kernel through Pallas' interpreter), one device,
16-bit compute, a head dim of 64, 128 or 256 and at most 16 query heads a kv head, and the kernel
tried once for that kind of head on this GPU (`gpu.tried`): where it does not lower or answers
wrong, decode's attention stays on XLA's einsums.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer import gpu
from jaxinfer.config import ModelConfig

BLOCK_K = 64  # keys a step of a program: [16, 64] scores, [64, head dim] keys and values in registers
HEADS = 16  # query rows a program holds (a kv head's G, padded)
HEAD_DIMS = (64, 128, 256)  # Triton's tiles are powers of two
MIN = float(jnp.finfo(jnp.float32).min)


def here(cfg: ModelConfig, dtype) -> bool:
    """Whether decode's attention of this model, computing in `dtype`, takes the kernel."""
    fits = gpu.kernels_run() and (
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and cfg.head_dim in HEAD_DIMS
        and cfg.num_heads // cfg.num_kv_heads <= HEADS
    )
    kind = (cfg.head_dim, jnp.dtype(dtype).name, cfg.kv_dtype == "int8", bool(cfg.attn_softcap))
    return fits and (gpu.MODE == "interpret" or _works(*kind))


@functools.cache
def _works(head_dim: int, dtype: str, quantized: bool, softcap: bool) -> bool:
    """The kernel, for this kind of head, compiled on this GPU and equal to XLA's attention."""
    return gpu.tried(partial(_check, head_dim, dtype, quantized, softcap))


def _check(head_dim: int, dtype: str, quantized: bool, softcap: bool) -> bool:
    """Two rows at positions in different shares, against the softmax over their keys in float32."""
    rows, kv_heads, group, length, cap = 2, 2, 4, 4 * BLOCK_K, 30.0 if softcap else None
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (rows, kv_heads, group, head_dim)).astype(dtype)
    shape = (1, rows, length, kv_heads, head_dim)
    if quantized:  # codes and per-position scales as an int8 cache holds them
        k, v = (jax.random.randint(key, shape, -127, 128).astype(jnp.int8) for key in keys[1:3])
        scales = tuple(jax.random.uniform(key, shape[:-1], minval=0.005, maxval=0.02) for key in keys[3:])
        dense = [a * s[..., None] for a, s in zip((k, v), scales)]
    else:
        k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys[1:3])
        scales, dense = (None, None), [k, v]
    positions = jnp.asarray([length - 1, BLOCK_K + 3])
    got = attend(q, positions, k, v, *scales, 0, None, length, None, head_dim**-0.5, cap)
    k, v = (a[0].astype(jnp.float32) for a in dense)  # [rows, length, KV, hd]
    scores = jnp.einsum("bkgh,bskh->bkgs", q.astype(jnp.float32), k) * head_dim**-0.5
    scores = scores if cap is None else jnp.tanh(scores / cap) * cap
    seen = jnp.arange(length)[None, :] <= positions[:, None]
    weights = jax.nn.softmax(jnp.where(seen[:, None, None], scores, -jnp.inf), -1)
    expected = jnp.einsum("bkgs,bskh->bkgh", weights, v)
    return bool(jnp.abs(got - expected).max() <= 2e-2 * jnp.abs(expected).max())


def attend(
    q: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    layer: int,
    rows: jax.Array | None,
    kv_len: int,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """Queries q [R, KV, G, hd] (one per row, at positions [R]) over `layer`'s keys and values
    k, v [L, B, S, KV, hd] of cache rows `rows` [R] (None: the first R), at most `kv_len` positions
    (static); int8 with scales [L, B, S, KV]. Returns the attention float32 [R, KV, G, hd]."""
    R, KV, G, hd = q.shape
    rows = jnp.arange(R, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    block = min(BLOCK_K, kv_len)
    splits = gpu.split(kv_len // block, R * KV)
    out, top, total = _attend(
        rows,
        positions.astype(jnp.int32),
        q,
        k,
        v,
        *(() if k_scale is None else (k_scale, v_scale)),
        layer=layer,
        kv_len=kv_len,
        block=block,
        share=kv_len // splits,
        window=window,
        scale=scale,
        softcap=softcap,
        interpret=gpu.MODE == "interpret",
    )
    # the shares merged: each weighted by how far its max lies below the row's (a share that saw no
    # key holds max MIN, sum 0: weight 0)
    weight = jnp.exp(top - top.max(2, keepdims=True))  # [R, KV, splits, G]
    return (out * weight[..., None]).sum(2) / (total * weight).sum(2)[..., None]


@partial(jax.jit, static_argnames=("layer", "kv_len", "block", "share", "window", "scale", "softcap", "interpret"))
def _attend(rows, positions, q, k, v, *scales, layer, kv_len, block, share, window, scale, softcap, interpret):
    R, KV, G, hd = q.shape
    splits = kv_len // share
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
    whole = pl.BlockSpec()  # the array as it lies: the program indexes its row, head and keys
    # a kv head's G query heads in a block of HEADS rows: those past G are loaded as 0, never stored
    per_program = lambda *shape: pl.BlockSpec((None, None, None, *shape), lambda b, h, j: (b, h, j, *[0] * len(shape)))  # noqa: E731
    return pl.pallas_call(
        partial(
            _program,
            group=G,
            layer=layer,
            kv_len=kv_len,
            block=block,
            share=share,
            window=window,
            scale=scale,
            softcap=softcap,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((R, KV, splits, G, hd), jnp.float32),
            jax.ShapeDtypeStruct((R, KV, splits, G), jnp.float32),
            jax.ShapeDtypeStruct((R, KV, splits, G), jnp.float32),
        ],
        grid=(R, KV, splits),
        in_specs=[whole, whole, pl.BlockSpec((None, None, HEADS, hd), lambda b, h, j: (b, h, 0, 0))]
        + [whole] * (2 + len(scales)),
        out_specs=[per_program(HEADS, hd), per_program(HEADS), per_program(HEADS)],
        interpret=interpret,
        **params,
    )(rows, positions, q, k, v, *scales)


def _program(
    rows_ref, positions_ref, q_ref, k_ref, v_ref, *refs, group, layer, kv_len, block, share, window, scale, softcap
):
    """One row's, one kv head's, one share's: the unnormalised weighted values [G, hd], the scores'
    max and the weights' sum [G] over the share's visible keys (the first G of the block's rows)."""
    *scale_refs, out_ref, top_ref, total_ref = refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row, position = rows_ref[b], positions_ref[b]
    lowest = 0 if window is None else jnp.maximum(position - window + 1, 0)
    first = jnp.maximum(lowest // block, j * (share // block))
    last = jnp.minimum(jnp.minimum(position, kv_len - 1) // block + 1, (j + 1) * (share // block))
    heads = jnp.arange(HEADS) < group
    q = plgpu.load(q_ref, mask=heads[:, None], other=0)

    def step(i, carry):
        out, top, total = carry
        keys = pl.ds(i * block, block)
        scores = plgpu.dot(q, k_ref[layer, row, keys, h, :].astype(q.dtype), trans_b=True) * scale  # [HEADS, block]
        if scale_refs:
            scores *= scale_refs[0][layer, row, keys, h][None, :]
        if softcap:
            scores = jnp.tanh(scores / softcap) * softcap
        at = i * block + jnp.arange(block)
        scores = jnp.where(((at >= lowest) & (at <= position))[None, :], scores, MIN)
        new = jnp.maximum(top, scores.max(1))
        weights = jnp.exp(scores - new[:, None])
        before = jnp.exp(top - new)
        total = total * before + weights.sum(1)
        if scale_refs:
            weights *= scale_refs[1][layer, row, keys, h][None, :]
        values = v_ref[layer, row, keys, h, :].astype(q.dtype)
        return out * before[:, None] + plgpu.dot(weights.astype(q.dtype), values), new, total

    start = (jnp.zeros((HEADS, q.shape[1]), jnp.float32), jnp.full(HEADS, MIN), jnp.zeros(HEADS, jnp.float32))
    out, top, total = jax.lax.fori_loop(first, last, step, start)
    plgpu.store(out_ref, out, mask=heads[:, None])
    plgpu.store(top_ref, top, mask=heads)
    plgpu.store(total_ref, total, mask=heads)
