"""The preallocated, fixed-shape KV cache: one stacked array per K and V, passed in and returned.

Its shape never changes, so decode compiles once per cache size; every jit that returns it donates it,
so XLA updates it in place instead of copying gigabytes per step.

`--kv-dtype bfloat16` stores K and V in 16 bits whatever the compute dtype (the CPU computes in
float32): half the bytes a decode step's attention reads, as llama.cpp's default float16 cache. On
the CPU a bfloat16 cache is held as its bits (uint16): XLA CPU widens a bfloat16 array around every
write, rewriting a layer's whole cache each step (Gemma 4 E4B shape, Q4_K_M: 0.2 ms a layer, the
step 25.5 → 29.5 ms), never an integer one.

`--kv-dtype int8` stores each head's vector of K and V at a position as int8 with one float32
scale (max|x| / 127), quantized once when written: 68 bytes per 64-value head instead of 256, so
3.8× the context fits (1.9× against bfloat16). A scale is constant along the head dimension, so
XLA's attention never dequantizes: K's scales multiply the scores, V's the attention weights; the
CPU kernel multiplies the scores by K's and widens each value times its scale.

Who attends over it (`KVCache.kernel`, decided once, when it is made): the CPU kernel where it is
built ("cpu", in its own layout); on a GPU the Pallas kernel of `jaxinfer.gpu_attention` ("gpu", in
XLA's layout; a fresh prompt goes to cuDNN's flash attention first where that fits, `model.flash`);
elsewhere XLA's einsums (`model._attend`). The CPU's kernel serves both phases; the GPU's a prompt's
chunks and speculative checks, a decode step's one query going to XLA's einsums (`attends`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from jaxinfer import gpu_attention, kernel
from jaxinfer.config import ModelConfig
from jaxinfer.errors import JaxinferError
from jaxinfer.layers.delta_net import DeltaState

KV_DTYPES = ("auto", "bfloat16", "int8")


def check_kv_dtype(name: str | None) -> str | None:
    """The `kv_dtype` parameter as `ModelConfig.kv_dtype`: auto (or none) is None, the compute dtype."""
    if name not in (None, *KV_DTYPES):
        raise JaxinferError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {name!r}", "kv_dtype")
    return None if name in (None, "auto") else name


def quantize_heads(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., hd] → (int8 [..., hd], float32 scale [...]): symmetric, one scale per head vector."""
    x = x.astype(jnp.float32)
    scale = jnp.abs(x).max(-1) / 127
    q = jnp.round(x / jnp.where(scale > 0, scale, 1)[..., None])
    return q.astype(jnp.int8), scale


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """A model's memory of each row's past: K/V of its attention layers and, for a hybrid, the
    fixed-size state of its recurrent layers (`delta`: `jaxinfer.layers.delta_net.DeltaState`).

    K/V are held in groups, one stacked array each for the layers of one shape (kv heads, head
    dim): one group for most models, two for Gemma 4 (its full layers' heads are wider). A layer
    that shares an earlier layer's K/V (Gemma 4's last layers) has none of its own: `where` sends it
    to the earlier layer's."""

    k: tuple  # per group [L, B, S, KV, hd]; the kernel's [L, B, KV, S, hd] (`attend`); L: the group's layers
    v: tuple  # as k
    k_scale: tuple | None = None  # per group [L, B, S, KV] when k and v are int8; the kernel's [L, B, KV, S]
    v_scale: tuple | None = None
    delta: DeltaState | None = None  # a hybrid's DeltaNet layers' state
    # a mixture's: the experts its passes read, each pass's distinct experts summed over its layers
    # and over the passes (uint32, wrapping: a count is a difference of two readings mod 2**32); the
    # roofline's measured count of the experts' bytes (`count_experts`)
    experts_read: jax.Array | None = None
    kernel: str | None = field(default=None, metadata=dict(static=True))  # who attends: "cpu", "gpu" (`attend`)
    # per model layer: (group, index in it) of the K/V it attends over; None: a layer without attention
    where: tuple = field(default=(), metadata=dict(static=True))

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype, whole: bool = True) -> KVCache:
        """An empty cache in `dtype` (bfloat16 where `cfg.kv_dtype` says so; a bfloat16 cache held as
        its bits on the CPU), or in int8 with scales where `cfg.kv_dtype` says so. On one
        device (`whole`: not spread over a mesh, whose shards a kernel's custom call would gather
        every layer) a float cache is attended by the CPU kernel where it is built, and any cache
        by the GPU's where that runs (`gpu_attention.here`)."""
        shapes = sorted({(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in cfg.cached_layers}, reverse=True)
        groups = [[i for i in cfg.cached_layers if (cfg.kv_heads_of(i), cfg.head_dim_of(i)) == s] for s in shapes]
        held = {i: (g, group.index(i)) for g, group in enumerate(groups) for i in group}
        where = tuple(held.get(cfg.kv_source(i)) for i in range(cfg.num_layers))
        sixteen = cfg.kv_dtype != "bfloat16" or dtype == jnp.bfloat16  # the GPU's kernel: q and K/V of one dtype
        gpu = "gpu" if whole and sixteen and gpu_attention.here(cfg, dtype) else None
        cpu = whole and kernel.vectorised() and all(hd in kernel.ATTENTION_HEAD_DIMS for _, hd in shapes)
        read = jnp.zeros((), jnp.uint32) if cfg.num_experts else None
        rest = dict(delta=DeltaState.zeros(cfg, batch, dtype), experts_read=read, where=where)
        rest["kernel"] = "cpu" if cpu else gpu
        if cpu:  # the kernel's layout: see `attend`
            shaped = [(len(group), batch, heads, length, hd) for group, (heads, hd) in zip(groups, shapes)]
        else:
            shaped = [(len(group), batch, length, heads, hd) for group, (heads, hd) in zip(groups, shapes)]
        if cfg.kv_dtype == "int8":
            int8 = tuple(jnp.zeros(shape, jnp.int8) for shape in shaped)
            scales = tuple(jnp.zeros(shape[:-1], jnp.float32) for shape in shaped)
            return cls(int8, tuple(a.copy() for a in int8), scales, tuple(a.copy() for a in scales), **rest)
        if cfg.kv_dtype == "bfloat16":
            dtype = jnp.bfloat16
        if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":  # its bits: see the module's docstring
            dtype = jnp.uint16
        k = tuple(jnp.zeros(shape, dtype) for shape in shaped)
        return cls(k, tuple(jnp.zeros(shape, dtype) for shape in shaped), **rest)

    @property
    def length(self) -> int:
        """Positions a row holds: S."""
        return self.k[0].shape[3 if self.kernel == "cpu" else 2]

    def positions_read(self, cfg: ModelConfig, kv_len: int, first: float, last: float) -> float:
        """Cache positions (the mean over layers) a decode pass reads, over passes of a row whose lengths
        (its newest position included) ran from `first` to `last`, attending over a bucket of `kv_len`:
        a kernel reads the row's own, within each layer's sliding window (at their mean length: exact
        without speculation, where each pass adds one); XLA's einsums the whole bucket. The roofline's
        decode bytes."""
        if not self.attends(1):
            return kv_len
        length = (first + last) / 2
        windows = [cfg.sliding_windows[i] for i in cfg.cached_layers] if cfg.sliding_windows else [None]
        return sum(min(length, window or length) for window in windows) / len(windows)

    def attends(self, queries: int) -> bool:
        """Whether its kernel attends `queries` queries a row (else XLA's einsums do, over the
        bucket): the CPU's always; the GPU's more than one (a prompt's chunk, a speculative check).
        A decode step's one query took longer by the GPU's kernel than by XLA: over a bucket of 1024
        (decode at 968) 22.4 µs a layer against 10.4 on the 1B shape, 19.3 against 11.5 on the 8B;
        the kernel's best tiles 12.1 and 12.5, a Pallas kernel of the same grid that only stores
        zeros already 12.5 and 19.5 (an H100, `scripts/sweep_gpu_kernels.py`); the 1B's step 1.258
        ms with it, 1.203 without (an H200), and at 3000 positions it took 64 µs a layer (an H200)."""
        return self.kernel == "cpu" or (self.kernel == "gpu" and queries > 1)

    def copy_rows(self, src: jax.Array, dst: jax.Array) -> KVCache:
        """Rows `dst` [R] take the K/V of rows `src` [R] (every layout keeps rows on axis 1)."""
        move = lambda a: a.at[:, dst].set(a[:, src])  # noqa: E731
        moved = jax.tree.map(move, self.kv_only)
        return replace(moved, delta=self.delta and self.delta.copy_rows(src, dst), experts_read=self.experts_read)

    @property
    def kv_only(self) -> KVCache:
        """Itself without what is not held a row a position (the recurrent state, the count)."""
        return replace(self, delta=None, experts_read=None)

    def count_experts(self, read: jax.Array) -> KVCache:
        """Itself having read `read` more experts (a pass's distinct experts of one layer,
        `feed_forward.feed_forward`)."""
        if self.experts_read is None:
            return self
        return replace(self, experts_read=self.experts_read + read.astype(jnp.uint32))

    def read(self, layer: int, start, size: int, rows: jax.Array | None = None):
        """(k, v, k_scale, v_scale) of `layer`'s `size` positions from `start` (traced or not) for
        cache rows `rows` (default: all): [B, size, KV, hd] each, the scales [B, size, KV] or None.
        Some rows (a batch slot's prefill): a gather of just those. XLA's attention only: the
        kernel reads its own cache (`attend`)."""

        g, j = self.where[layer]

        def pick(a):
            block = jax.lax.dynamic_slice_in_dim(a[g][j], start, size, 1)
            return _floats(block if rows is None else block[rows])

        scales = (None, None) if self.k_scale is None else (pick(self.k_scale), pick(self.v_scale))
        return pick(self.k), pick(self.v), *scales

    def attend(
        self,
        layer: int,
        q: jax.Array,
        positions: jax.Array,
        rows: jax.Array | None,
        kv_len: int,
        window: int | None,
        scale: float,
        softcap: float | None,
        sinks: jax.Array | None = None,
    ) -> jax.Array:
        """The kernel's attention (`kernel`: the CPU's or the GPU's) of queries q [B, T, KV, G, hd]
        at positions [B, T] over `layer`'s first `kv_len` positions of cache rows `rows` (default:
        all), float32 [B, T, KV, G, hd]: it reads the cache where it lies, each query's keys up to
        its own position. The CPU kernel's cache is held by kv head, [L, B, KV, S, hd], so the keys
        one item of the kernel reads are one contiguous run; held by position as XLA's (a row's kv
        heads interleaved), decode's attention took 10% longer (SmolLM-135M shape, B=16 over 128
        positions: 6.7 → 7.5 ms a step) and a B=4 decode step over 2048 positions 11% longer. The
        GPU's (`jaxinfer.gpu_attention`) reads it in XLA's layout, [L, B, S, KV, hd]. `sinks` [H]:
        each head's sink logit (gpt-oss's)."""
        g, j = self.where[layer]
        if self.kernel == "gpu":
            scales = (None, None) if self.k_scale is None else (self.k_scale[g], self.v_scale[g])
            return gpu_attention.attend(
                q, positions, self.k[g], self.v[g], *scales, j, rows, kv_len, window, scale, softcap, sinks
            )
        rows = jnp.arange(q.shape[0]) if rows is None else rows
        scales = (None, None) if self.k_scale is None else (self.k_scale[g], self.v_scale[g])
        kv = (self.k[g], self.v[g])
        return kernel.attention(q, positions, *kv, rows, j, kv_len, window, scale, softcap, sinks, *scales)

    def write(
        self, layer: int, k: jax.Array, v: jax.Array, positions: jax.Array, rows: jax.Array | None = None
    ) -> KVCache:
        """Store k, v [R, T, KV, hd] at `positions` [R, T] of cache rows `rows` [R] (default: the
        first R) in `layer`; positions ≥ S are dropped.

        A scatter into the whole stacked array (not `cache[layer]` then `.at[layer].set`), so XLA
        keeps the update in place.
        """
        rows = (jnp.arange(k.shape[0]) if rows is None else rows)[:, None]  # [R, 1]
        g, j = self.where[layer]
        # either way [R, T, KV, hd]
        at = (j, rows, slice(None), positions) if self.kernel == "cpu" else (j, rows, positions)

        def put(arrays: tuple, x: jax.Array) -> tuple:
            """The groups, group g's array with x scattered in."""
            return (*arrays[:g], arrays[g].at[at].set(_held(x, arrays[g].dtype), mode="drop"), *arrays[g + 1 :])

        if self.k_scale is None:
            return replace(self, k=put(self.k, k), v=put(self.v, v))
        (kq, ks), (vq, vs) = quantize_heads(k), quantize_heads(v)
        return replace(
            self, k=put(self.k, kq), v=put(self.v, vq), k_scale=put(self.k_scale, ks), v_scale=put(self.v_scale, vs)
        )


def _held(x: jax.Array, dtype) -> jax.Array:
    """x as a cache of `dtype` holds it: bfloat16's bits where it holds them as uint16."""
    if dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def _floats(x: jax.Array) -> jax.Array:
    """What a cache holds as values: bfloat16 bits (uint16) as bfloat16, anything else as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x
