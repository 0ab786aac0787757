"""Attention over the cache on a GPU, where cuDNN's does not serve (`model.flash`): a prompt's later
chunks, speculative checks, soft-capping, float32, int8 caches, attention sinks (gpt-oss's: a head's
sink logit joins the merge of the shares as one more share). A Pallas kernel, lowered through
Triton: flash attention reading the cache where it lies, each query up to its own position (not the
whole kv bucket), split over the keys where the queries alone would not fill the GPU (flash-decoding's
split-K).

Through XLA a chunk's attention runs as several kernels a layer over the whole bucket (scores, mask,
max, exp, sums, the value product), a bucket holds up to twice the positions a row has written, and a
fresh prompt that cuDNN could not take held its [T, T] scores in memory. A decode step's one query is
XLA's all the same (`KVCache.attends`): measured, its einsums took less than this kernel's call alone
(a kernel of the same grid that only stores zeros: 12.5-19.5 µs a layer; XLA's whole attention
10.4-11.5; `scripts/sweep_gpu_kernels.py`).

Here a kv head's queries are rows (each of its T positions × its G query heads, `queries`), and one
program takes one cache row, one kv head, a block of up to `ROWS` query rows and one share of the
keys: it walks its share `BLOCK_K` keys at a time with the running softmax, visiting only the blocks
between its rows' first visible key (a sliding window's) and their last position; shares past them
do nothing. XLA then merges the shares' (max, sum, weighted values); one share normalises in the
kernel. int8 K/V are converted in registers, their per-position scales multiplying the scores (K)
and the weights (V), as the XLA path does (`model._attend`).

Which caches take it: `KVCache.zeros` says once, per cache (`here`): a GPU (or `gpu.MODE`
"interpret", where the CPU tests run the same kernel through Pallas' interpreter), one device, a
head dim of 64, 128 or 256, and the kernel tried once for that kind of head on this GPU
(`gpu.tried`): where it does not lower or answers wrong, attention stays on XLA's einsums.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer import gpu
from jaxinfer.config import ModelConfig

BLOCK_K = 64  # keys a step of a program: [rows, 64] scores, [64, head dim] keys and values
ROWS = 64  # query rows a program holds at most (positions × query heads of one kv head)
MIN_ROWS = 16  # and at least: Triton's dot takes 16 rows (decode's G heads are padded to it)
HEAD_DIMS = (64, 128, 256)  # Triton's tiles are powers of two
DTYPES = ("bfloat16", "float16", "float32")  # float32: its products in full precision (IEEE), as XLA's
MIN = float(jnp.finfo(jnp.float32).min)


@dataclass(frozen=True)
class Tiles:
    """How the kernel cuts attention (`scripts/sweep_gpu_kernels.py` tries them on a GPU): `block`
    keys a step, the keys split until there are `programs` programs (or into `splits` shares), Triton's
    `warps` and `stages`. One share normalises in the kernel (no merge by XLA)."""

    block: int = BLOCK_K
    splits: int | None = None
    programs: int = gpu.PROGRAMS
    warps: int = 4
    stages: int = 2


TILES = Tiles()


def here(cfg: ModelConfig, dtype) -> bool:
    """Whether attention over this model's cache, computing in `dtype`, takes the kernel."""
    name = jnp.dtype(dtype).name
    dims = {cfg.head_dim_of(i) for i in cfg.cached_layers}
    if not (gpu.kernels_run() and name in DTYPES and dims <= set(HEAD_DIMS)):
        return False
    return gpu.MODE == "interpret" or _works(cfg.head_dim, name, cfg.kv_dtype == "int8", bool(cfg.attn_softcap))


@functools.cache
def _works(head_dim: int, dtype: str, quantized: bool, softcap: bool) -> bool:
    """The kernel, for this kind of head, compiled on this GPU and equal to the softmax over the keys."""
    return gpu.tried(partial(_check, head_dim, dtype, quantized, softcap))


def _check(head_dim: int, dtype: str, quantized: bool, softcap: bool) -> bool:
    """Two rows of three queries (one in each of two shares, the other in one share's middle),
    against the softmax over their keys in float32."""
    rows, kv_heads, group, length, cap = 2, 2, 4, 4 * BLOCK_K, 30.0 if softcap else None
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (rows, 3, kv_heads, group, head_dim)).astype(dtype)
    shape = (1, rows, length, kv_heads, head_dim)
    if quantized:  # codes and per-position scales as an int8 cache holds them
        k, v = (jax.random.randint(key, shape, -127, 128).astype(jnp.int8) for key in keys[1:3])
        scales = tuple(jax.random.uniform(key, shape[:-1], minval=0.005, maxval=0.02) for key in keys[3:])
        dense = [a * s[..., None] for a, s in zip((k, v), scales)]
    else:
        k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys[1:3])
        scales, dense = (None, None), [k, v]
    positions = jnp.asarray([[length - 3, length - 2, length - 1], [BLOCK_K + 3, BLOCK_K + 4, BLOCK_K + 5]])
    got = attend(q, positions, k, v, *scales, 0, None, length, None, head_dim**-0.5, cap)
    k, v = (a[0].astype(jnp.float32) for a in dense)  # [rows, length, KV, hd]
    scores = jnp.einsum("btkgh,bskh->btkgs", q.astype(jnp.float32), k, precision="highest") * head_dim**-0.5
    scores = scores if cap is None else jnp.tanh(scores / cap) * cap
    seen = jnp.arange(length) <= positions[..., None]  # [rows, 3, length]
    weights = jax.nn.softmax(jnp.where(seen[:, :, None, None], scores, -jnp.inf), -1)
    expected = jnp.einsum("btkgs,bskh->btkgh", weights, v, precision="highest")
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
    sinks: jax.Array | None = None,
    tiles: Tiles | None = None,
) -> jax.Array:
    """Queries q [R, T, KV, G, hd] at positions [R, T] over `layer`'s keys and values k, v
    [L, B, S, KV, hd] of cache rows `rows` [R] (None: the first R), at most `kv_len` positions
    (static), each query over the keys at its position and before (within the window); int8 with
    scales [L, B, S, KV]; `sinks` [KV·G]: each head's sink logit (gpt-oss's). Returns the attention
    float32 [R, T, KV, G, hd]."""
    R, T, KV, G, hd = q.shape
    queries = T * G  # a kv head's query rows: position t's heads at t·G … t·G + G - 1
    block_rows = min(ROWS, max(MIN_ROWS, pl.next_power_of_2(queries)))
    blocks = pl.cdiv(queries, block_rows)
    # whole blocks even where fewer keys are held (Triton's dot takes 16 at least): a bucket capped by the
    # context, or a short sequence without a cache, ends mid-block, its last block read masked
    tiles = tiles or TILES
    block = tiles.block
    key_blocks = pl.cdiv(kv_len, block)
    splits = (
        math.gcd(tiles.splits, key_blocks) if tiles.splits else gpu.split(key_blocks, R * KV * blocks, tiles.programs)
    )
    out, top, total = _attend(
        jnp.arange(R, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32),
        jnp.full(1, layer, jnp.int32),  # an operand, not a constant: every layer runs one compiled kernel
        jnp.repeat(positions.astype(jnp.int32), G, axis=1),  # each query row's position [R, T·G]
        jnp.moveaxis(q, 2, 1).reshape(R, KV, queries, hd),
        k,
        v,
        *(() if k_scale is None else (k_scale, v_scale)),
        kv_len=kv_len,
        block=block,
        block_rows=block_rows,
        splits=splits,
        normalize=splits == 1 and sinks is None,
        window=window,
        scale=scale,
        softcap=softcap,
        warps=tiles.warps,
        stages=tiles.stages,
        interpret=gpu.MODE == "interpret",
    )
    if splits == 1 and sinks is None:  # normalised in the kernel
        return jnp.moveaxis(out[:, :, 0].reshape(R, KV, T, G, hd), 1, 2)
    if sinks is not None:  # a head's sink joins its softmax as one more share: max the sink, sum 1, no values
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(KV, G), (1, T))  # [KV, T·G], as the query rows
        top = jnp.concatenate([top, jnp.broadcast_to(sink[None, :, None], (R, KV, 1, queries))], axis=2)
        total = jnp.concatenate([total, jnp.ones((R, KV, 1, queries), jnp.float32)], axis=2)
        out = jnp.concatenate([out, jnp.zeros((R, KV, 1, queries, hd), jnp.float32)], axis=2)
    # the shares merged: each weighted by how far its max lies below the query's (a share that saw
    # no key holds max MIN, sum 0: weight 0; a query that saw none at all, 0)
    weight = jnp.exp(top - top.max(2, keepdims=True))  # [R, KV, splits, queries]
    total = (total * weight).sum(2)
    merged = (out * weight[..., None]).sum(2) / jnp.where(total > 0, total, 1)[..., None]
    return jnp.moveaxis(merged.reshape(R, KV, T, G, hd), 1, 2)


@partial(
    jax.jit,
    static_argnames=(
        "kv_len",
        "block",
        "block_rows",
        "splits",
        "normalize",
        "window",
        "scale",
        "softcap",
        "warps",
        "stages",
        "interpret",
    ),
)
def _attend(
    rows,
    layer,
    positions,
    q,
    k,
    v,
    *scales,
    kv_len,
    block,
    block_rows,
    splits,
    normalize,
    window,
    scale,
    softcap,
    warps,
    stages,
    interpret,
):
    R, KV, queries, hd = q.shape
    blocks = pl.cdiv(queries, block_rows)
    params = {}
    if not interpret:
        params["compiler_params"] = plgpu.CompilerParams(num_warps=warps, num_stages=stages)
    whole = pl.BlockSpec()  # the array as it lies: the program indexes its cache row, head and keys
    # program (b, h, i · splits + j): query block i, share j; a last block's rows past `queries` are
    # loaded as 0 and never stored
    per_program = lambda *shape: pl.BlockSpec(  # noqa: E731
        (None, None, None, block_rows, *shape), lambda b, h, ij: (b, h, ij % splits, ij // splits, *[0] * len(shape))
    )
    kernel = partial(
        _program,
        queries=queries,
        splits=splits,
        normalize=normalize,
        kv_len=kv_len,
        block=block,
        share=pl.cdiv(kv_len, block) // splits,  # blocks of keys a share
        window=window,
        scale=scale,
        softcap=softcap,
    )
    return pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((R, KV, splits, queries, hd), jnp.float32),
            jax.ShapeDtypeStruct((R, KV, splits, queries), jnp.float32),
            jax.ShapeDtypeStruct((R, KV, splits, queries), jnp.float32),
        ],
        grid=(R, KV, blocks * splits),
        in_specs=[
            whole,
            whole,
            pl.BlockSpec((None, block_rows), lambda b, h, ij: (b, ij // splits)),
            pl.BlockSpec((None, None, block_rows, hd), lambda b, h, ij: (b, h, ij // splits, 0)),
        ]
        + [whole] * (2 + len(scales)),
        out_specs=[per_program(hd), per_program(), per_program()],
        interpret=interpret,
        name="jaxinfer_attention",
        **params,
    )(rows, layer, positions, q, k, v, *scales)


def _program(
    rows_ref,
    layer_ref,
    positions_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    queries,
    splits,
    normalize,
    kv_len,
    block,
    share,  # blocks of keys
    window,
    scale,
    softcap,
):
    """One cache row's, one kv head's, one block of query rows', one share's: the weighted values
    [rows, hd] (unnormalised unless `normalize`), the scores' max and the weights' sum [rows] over the
    share's keys each query row sees."""
    *scale_refs, out_ref, top_ref, total_ref = refs
    b, h, ij = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i, j = ij // splits, ij % splits
    rows = q_ref.shape[0]
    live = i * rows + jnp.arange(rows) < queries
    row, layer = rows_ref[b], layer_ref[0]
    position = plgpu.load(positions_ref, mask=live, other=0)  # [rows]
    lowest = jnp.zeros_like(position) if window is None else jnp.maximum(position - window + 1, 0)
    first = jnp.maximum(jnp.min(jnp.where(live, lowest, kv_len)) // block, j * share)
    position = jnp.minimum(position, kv_len - 1)  # a finished row's (past the bucket) sees what it holds
    last = jnp.minimum(jnp.max(jnp.where(live, position, 0)) // block + 1, (j + 1) * share)
    q = plgpu.load(q_ref, mask=live[:, None], other=0)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def read(ref, at, keys):  # [block, ...] of the cache; keys past a bucket that ends mid-block: 0
        if kv_len % block == 0:
            return ref[(layer, row, keys, h) + (slice(None),) * (len(ref.shape) - 4)]
        inside = (at < kv_len)[(slice(None),) + (None,) * (len(ref.shape) - 4)]
        return plgpu.load(ref.at[layer, row, keys, h], mask=inside, other=0)  # (a masked load's indices are arrays)

    def step(n, carry):
        out, top, total = carry
        keys, at = pl.ds(n * block, block), n * block + jnp.arange(block)
        k = read(k_ref, at, keys).astype(q.dtype)
        scores = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [rows, block]
        if scale_refs:
            scores *= read(scale_refs[0], at, keys)[None, :]
        if softcap:
            scores = jnp.tanh(scores / softcap) * softcap
        seen = (at[None, :] >= lowest[:, None]) & (at[None, :] <= position[:, None])
        new = jnp.maximum(top, jnp.where(seen, scores, MIN).max(1))
        weights = jnp.where(seen, jnp.exp(scores - new[:, None]), 0.0)
        before = jnp.exp(top - new)
        total = total * before + weights.sum(1)
        if scale_refs:
            weights *= read(scale_refs[1], at, keys)[None, :]
        values = read(v_ref, at, keys).astype(q.dtype)
        out = out * before[:, None] + plgpu.dot(weights.astype(q.dtype), values, precision=precision)
        return out, new, total

    start = (jnp.zeros((rows, q.shape[1]), jnp.float32), jnp.full(rows, MIN), jnp.zeros(rows, jnp.float32))
    out, top, total = jax.lax.fori_loop(first, last, step, start)
    if normalize:  # the only share (and no sinks to join): normalised here (a query that saw no key: 0)
        out = out / jnp.where(total > 0, total, 1)[:, None]
    plgpu.store(out_ref, out, mask=live[:, None])
    plgpu.store(top_ref, top, mask=live)
    plgpu.store(total_ref, total, mask=live)
