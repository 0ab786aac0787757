"""Block-quantized matrices on a GPU: weight-only int8 and int4 products that read the codes as
stored and dequantize in registers (a Pallas kernel, lowered through Triton).

On an H100, XLA could not do this: it wrote every dequantized matrix out as bfloat16 before its
matmul (`--quantize int8` decoded the Llama-3.2-1B shape at ×0.54 of bfloat16), and no fused form
of the dequantization beat bfloat16's own product (BENCHMARKS.md, "On a GPU";
`scripts/bench_int8_forms.py`). Here a matrix is held in *columns* (`to_columns`): codes [in, out] (4 bits: two to
a byte, a block's rows 0-15 in the low nibbles and 16-31 in the high ones, [in/2, out]) and scales
[in/32, out]. Each program of the kernel takes `BN` outputs and a share of the inputs; per block of
32 inputs it multiplies the rows' [M, 32] inputs by the block's codes on the tensor cores and adds the
product times the block's scales, so every byte of the matrix is read once, as stored. Decode's few
rows (M ≤ `ROWS`) take it; more rows (prefill, large batches) are compute-bound, and XLA's product
of the dequantized matrix serves them.

`MODE` (`JAXINFER_GPU_KERNELS` in the environment) "interpret" runs this module's kernel and
`gpu_attention`'s through Pallas' interpreter on any backend (the CPU tests check what the GPU
runs); "off" never runs them (XLA does their work, to compare); unset, they run where the backend is
a GPU and the kernel, tried once on a small case, compiles and answers right there (`_works`): where
it does not, matrices stay packed and XLA multiplies them, as before the kernel.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.errors import JaxinferError
from jaxinfer.quant import BLOCK, GROUP, METHODS, pack, quantize

ROWS = 16  # the kernel's rows: Triton's dot takes 16 at least; decode's batches up to 16 take it
BN = 128  # outputs per program at most (fewer where they do not divide the matrix's: a power of two ≥ 16)
PROGRAMS = 264  # at least this many programs (2 per multiprocessor of an H100): the inputs split until there are
MODE: str | None = os.environ.get("JAXINFER_GPU_KERNELS") or None  # "interpret", "off"; None: on a GPU
if MODE not in (None, "interpret", "off"):
    raise JaxinferError(f"JAXINFER_GPU_KERNELS must be interpret or off, not {MODE!r}")


def kernels_run() -> bool:
    """Whether this module's kernels (and `gpu_attention`'s) may run here: on a GPU, or anywhere
    through Pallas' interpreter (`MODE` "interpret")."""
    return MODE == "interpret" or (MODE is None and jax.default_backend() == "gpu")


def kernel_here() -> bool:
    """Whether quantized matrices take the kernel: where it may run and, on a GPU, works (`_works`)."""
    return kernels_run() and (MODE == "interpret" or _works())


@functools.cache
def _works() -> bool:
    """The kernel compiled and checked on this GPU: int8 and int4 columns of a 256 × 512 matrix, by
    three rows and by one, against their dequantized product (a failure to lower or a wrong answer
    turns it off)."""
    return tried(_check)


def tried(check) -> bool:
    """A GPU kernel's check, run once: its answer, False where it raised (it did not lower). On a
    thread of its own, whose JAX traces nothing: the first question may come while tracing
    (`lay_out` under `eval_shape`, a program that multiplies), where the check would be traced too."""
    answer = []

    def run():
        try:
            answer.append(bool(check()))
        except Exception:
            answer.append(False)

    thread = threading.Thread(target=run, name="jaxinfer-gpu-check")
    thread.start()
    thread.join()
    return answer[0]


def _check() -> bool:
    x = jax.random.normal(jax.random.key(0), (3, 512)).astype(jnp.bfloat16)
    for method in ("int8", "int4"):
        w = jax.random.normal(jax.random.key(1), (256, 512)) * 0.02
        columns = to_columns(quantize(w, method), method)
        for rows in (x, x[:1]):  # one row: its own tiles (`TILES`)
            got = quantized_matmul(rows, *columns, METHODS[method].bits)
            expected = jnp.dot(rows.astype(jnp.float32), columns_dense(columns, method))
            if not bool(jnp.abs(got - expected).max() <= 1e-3 * jnp.abs(expected).max()):
                return False
    return True


@dataclass(frozen=True)
class Tiles:
    """How the kernel cuts a product (`scripts/sweep_gpu_kernels.py` tries them on a GPU). `kind`
    "dot": the rows padded to `ROWS` on the tensor cores, one product per block of 32 inputs; "fma":
    one row (M = 1) on the CUDA cores, no padding. `step` blocks an iteration reads together (its
    loads issued before its products, so many bytes are in flight), `bn` outputs a program, the inputs
    split until there are `programs` programs; `unpack` the 4-bit codes: "i32" (widened, then
    converted), "i8" (nibbles kept in 8 bits: Triton's fast int8 conversion), "magic" (a nibble
    ORed into bfloat16 128.0's bits, then 136 subtracted: no conversion at all); `pad`: the rows
    padded by XLA before the call (else loaded masked); `evict`: codes loaded "evict_first" (read
    once a step, they need not stay in L2)."""

    kind: str = "dot"
    step: int = 1
    bn: int = BN
    programs: int = PROGRAMS
    warps: int = 4
    stages: int = 3
    unpack: str = "i32"
    pad: bool = True
    evict: bool = False


# By the codes' bits, as `scripts/sweep_gpu_kernels.py` found them (an H100, the 8B shapes' matrices
# at one row, µs a product; BENCHMARKS.md): int8 on the CUDA cores, 2 blocks an iteration, 256
# outputs a program: q/k/v 20.2 → 19.6, o 18.7 → 13.3, gate/up 76.5 → 70.4, down 38.7 → 35.2 (−10%
# over the four). No cut of int4's beat the default; fatter iterations on the tensor cores (4 or 8
# blocks) were slower for both, 87-187 µs on gate/up: Triton did not keep more bytes in flight.
TILES = {8: Tiles(kind="fma", step=2, bn=256, stages=1), 4: Tiles()}


def _codes(q_ref, b: int | jax.Array, bits: int, unpack: str, evict: bool, dtype) -> tuple[jax.Array, ...]:
    """Block b's codes as `dtype` values: [32, bn] (8 bits), or its rows 0-15 and 16-31 (4 bits)."""
    rows = BLOCK * bits // 8
    at = q_ref.at[pl.ds(b * rows, rows), :]
    codes = plgpu.load(at, eviction_policy="evict_first") if evict else at[...]
    if bits == 8:
        return (codes.astype(dtype),)
    if unpack == "i32":
        wide = codes.astype(jnp.int32)
        return ((wide & 15) - 8).astype(dtype), ((wide >> 4) - 8).astype(dtype)
    if unpack == "i8":
        return ((codes & 15).astype(jnp.int8) - 8).astype(dtype), ((codes >> 4).astype(jnp.int8) - 8).astype(dtype)
    # "magic": 0x4300 | n is bfloat16 128 + n (a mantissa step of 1 at 2^7): minus 136, n - 8 exactly
    halves = ((codes & 15).astype(jnp.uint16), (codes >> 4).astype(jnp.uint16))
    return tuple((jax.lax.bitcast_convert_type(h | 0x4300, jnp.bfloat16) - 136).astype(dtype) for h in halves)


def _program(x_ref, q_ref, s_ref, o_ref, *, iterations: int, bits: int, m: int | None, tiles: Tiles):
    """One program's outputs [rows, bn] over its share of the inputs, `tiles.step` blocks of 32 an
    iteration, each block's product times its scales. `m`: the real rows, where they were not padded
    (the rest loaded as 0). The "fma" kind: one row on the CUDA cores, codes times inputs summed."""
    step, f32, fma = tiles.step, jnp.float32, tiles.kind == "fma"

    def inputs(at: int | jax.Array, width: int) -> jax.Array:
        if m is None:
            return x_ref[:, pl.ds(at, width)]
        live = (jnp.arange(ROWS) < m)[:, None]
        return plgpu.load(x_ref.at[pl.ds(0, ROWS), pl.ds(at, width)], mask=live, other=0)

    def product(x: jax.Array, codes: jax.Array) -> jax.Array:
        if fma:  # x [1, width]
            return (codes * x.astype(f32).reshape(-1, 1)).sum(0, keepdims=True)
        return jnp.dot(x, codes, preferred_element_type=f32)

    def iteration(n, total):
        blocks = [n * step + s for s in range(step)]  # every load first, then the products
        codes = [_codes(q_ref, b, bits, tiles.unpack, tiles.evict, f32 if fma else x_ref.dtype) for b in blocks]
        scales = [s_ref[pl.ds(b, 1), :].astype(f32) for b in blocks]  # [1, bn] each
        xs = [[inputs(b * BLOCK + i * len(c[0]), len(c[0])) for i in range(len(c))] for b, c in zip(blocks, codes)]
        for c, scale, x in zip(codes, scales, xs):
            total += sum(product(xi, ci) for xi, ci in zip(x, c)) * scale
        return total

    o_ref[...] = jax.lax.fori_loop(0, iterations, iteration, jnp.zeros(o_ref.shape, jnp.float32))


def split(k_blocks: int, programs: int, target: int = PROGRAMS, step: int = 1) -> int:
    """Into how many shares `k_blocks` blocks go (a matrix's inputs, attention's keys) so that
    `programs` programs a share make `target`: the fewest that do, each a whole number of `step`s."""
    shares = 1
    while programs * shares < target and k_blocks % (2 * shares * step) == 0:
        shares *= 2
    return shares


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, bits: int, tiles: Tiles | None = None) -> jax.Array:
    """x [M ≤ ROWS, in] @ the columns' matrix → [M, out] float32, by the kernel (`MODE`'s)."""
    return _quantized_matmul(x, q, scale, bits, MODE == "interpret", tiles or TILES[bits])


@partial(jax.jit, static_argnames=("bits", "interpret", "tiles"))
def _quantized_matmul(
    x: jax.Array, q: jax.Array, scale: jax.Array, bits: int, interpret: bool, tiles: Tiles
) -> jax.Array:
    M, K = x.shape
    N = scale.shape[1]
    fma = tiles.kind == "fma" and M == 1
    tiles = tiles if fma or tiles.kind == "dot" else Tiles()  # more rows: the tensor cores, as they come
    bn = next(n for n in (tiles.bn, 128, 64, 32, 16) if n <= tiles.bn and N % n == 0)  # outputs come in 16s
    step = next(s for s in (tiles.step, 8, 4, 2, 1) if s <= tiles.step and (K // BLOCK) % s == 0)
    tiles = replace(tiles, step=step)
    shares = split(K // BLOCK, N // bn, tiles.programs, step)
    share = K // shares  # inputs per program
    rows, m = (1, None) if fma else (ROWS, None if tiles.pad else M)
    if not fma and tiles.pad:
        x = jnp.zeros((ROWS, K), x.dtype).at[:M].set(x)
    params = {}
    if not interpret:
        params["compiler_params"] = plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages)
    iterations = share // BLOCK // step
    out = pl.pallas_call(
        partial(_program, iterations=iterations, bits=bits, m=m, tiles=tiles),
        out_shape=jax.ShapeDtypeStruct((shares, rows, N), jnp.float32),
        grid=(N // bn, shares),
        in_specs=[
            pl.BlockSpec((x.shape[0], share), lambda i, j: (0, j)),
            pl.BlockSpec((share * bits // 8, bn), lambda i, j: (j, i)),
            pl.BlockSpec((share // BLOCK, bn), lambda i, j: (j, i)),
        ],
        out_specs=pl.BlockSpec((None, rows, bn), lambda i, j: (j, 0, i)),
        interpret=interpret,
        name=f"jaxinfer_int{bits}_matmul",
        **params,
    )(x, q, scale)
    return out.sum(0)[:M]


# ------------------------------------------------------------------------------------ columns
# A scale-per-block method's matrix as the kernel reads it: codes [in, out] (int8; 4 bits: uint8
# [in/2, out], a block's rows 0-15 in the low nibbles and 16-31 in the high ones, each code + 8) and
# scales [in/32, out].


@functools.partial(jax.jit, static_argnames="method")
def to_columns(arrays: tuple, method: str) -> tuple[jax.Array, jax.Array]:
    """The packed leaf's arrays (int8, int4, q8_0, q4_0) as columns: the same codes and scales."""
    m, (q, scale) = METHODS[method], arrays
    groups, blocks = q.shape[:2]
    n, k = groups * GROUP, blocks * BLOCK
    codes = m.values(q).transpose(1, 2, 4, 0, 3).reshape(k, n)  # [k/32, chunk, 4, n/16, 16]: w[n, k] at [k, n]
    if m.bits == 8:
        codes = codes.astype(jnp.int8)
    else:
        halves = (codes + 8).astype(jnp.uint8).reshape(blocks, 2, BLOCK // 2, n)
        codes = (halves[:, 0] | (halves[:, 1] << 4)).reshape(k // 2, n)
    return codes, scale.transpose(1, 0, 2).reshape(blocks, n)


def _column_values(q: jax.Array, method: str) -> jax.Array:
    """Columns' codes → integer values [in, ...] (int32), the 4-bit ones unpacked and centred."""
    if METHODS[method].bits == 8:
        return q.astype(jnp.int32)
    wide = q.astype(jnp.int32).reshape(-1, BLOCK // 2, *q.shape[1:])
    return jnp.concatenate([(wide & 15) - 8, (wide >> 4) - 8], axis=1).reshape(-1, *q.shape[1:])


@functools.partial(jax.jit, static_argnames="method")
def from_columns(arrays: tuple, method: str) -> tuple[jax.Array, jax.Array]:
    """Columns' arrays packed again (as checkpoints store them: `forms.to_stored`)."""
    q, scale = arrays
    blocks, n = scale.shape
    values = _column_values(q, method).T.reshape(n, blocks, BLOCK)
    return pack(values + (8 if METHODS[method].bits == 4 else 0), scale.T, method)


def columns_dense(arrays: tuple, method: str, dtype=jnp.float32) -> jax.Array:
    """Columns' matrix [in, out] in `dtype`."""
    q, scale = arrays
    values = _column_values(q, method).astype(jnp.float32)
    return (values * jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=0)).astype(dtype)


def columns_matmul(x: jax.Array, arrays: tuple, method: str) -> jax.Array:
    """x [..., in] @ the columns' matrix → [..., out] float32: decode's few rows by the kernel (the
    codes read as stored), more rows by XLA's product of the dequantized matrix."""
    q, scale = arrays
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= ROWS and kernel_here():
        out = quantized_matmul(rows, q, scale, METHODS[method].bits)
    else:
        out = jnp.dot(rows, columns_dense(arrays, method, x.dtype), preferred_element_type=jnp.float32)
    return out.reshape(*x.shape[:-1], -1)


def columns_rows(arrays: tuple, method: str, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the [out, in] matrix from its columns (the embedding lookup)."""
    q, scale = arrays
    values = _column_values(q[:, ids.reshape(-1)], method).astype(jnp.float32)  # [in, ids]
    rows = values * jnp.repeat(scale[:, ids.reshape(-1)].astype(jnp.float32), BLOCK, axis=0)
    return rows.T.reshape(*ids.shape, -1).astype(dtype)
