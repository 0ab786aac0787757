"""The GPU's attention kernel (`jaxinfer.gpu_attention`) on the CPU, through Pallas' interpreter
(`gpu.MODE = "interpret"`; on a GPU, the kernel itself): decode's one query a row, a speculative
check's few, a prompt chunk's many (query rows over several blocks, the last one partial), each up
to its own position, within its sliding window, split over the keys, an int8 cache read as stored,
soft-capping, float32, a batch's rows picked from a larger cache; equal to XLA's attention
(`model._attend`) on the same cache, and a model generating what it generates through XLA (prompts
in chunks too). That the kernel lowers to Triton is checked here (JAX lowers for CUDA on any
machine); that it compiles and runs there, on a GPU."""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxinfer import gpu, gpu_attention, kernel, model
from jaxinfer.config import ModelConfig
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kvcache import KVCache, quantize_heads
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.slots import Decoding


@pytest.fixture
def interpret(monkeypatch):
    """The kernel through Pallas' interpreter; on a GPU, the kernel itself (Triton's)."""
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(gpu, "MODE", "interpret")
    monkeypatch.setattr(kernel, "enabled", False)  # the CPU kernel would take the cache first


def _cache(rows, length, kv_heads, hd, quantized, seed=0, dtype=jnp.bfloat16):
    """k, v [1, rows, length, KV, hd] (`dtype`, or int8 with scales [1, rows, length, KV])."""
    keys = jax.random.split(jax.random.key(seed), 2)
    k, v = (jax.random.normal(key, (1, rows, length, kv_heads, hd)).astype(dtype) for key in keys)
    if not quantized:
        return k, v, None, None
    (k, k_scale), (v, v_scale) = quantize_heads(k), quantize_heads(v)
    return k, v, k_scale, v_scale


def _xla(q, positions, cache, rows, kv_len, window, scale, softcap):
    """XLA's attention (the path the kernel replaces) over the same rows and positions, [R, T, KV, G, hd]."""
    read = [None if a is None else a[0][rows, :kv_len] for a in cache]
    _, total, out = model._attend(q, positions, window, scale, softcap, *read, 0)
    return jnp.moveaxis(out / total[..., None], 3, 1)


@pytest.mark.parametrize("programs", [gpu.PROGRAMS, 1])  # shares of one block each; one share of four
@pytest.mark.parametrize(
    "group, hd, window, softcap, quantized",
    [(4, 64, None, None, False), (1, 128, None, None, True), (8, 64, 40, None, False), (16, 64, 100, 5.0, True)],
)
def test_decode_attends_as_xla_does(interpret, monkeypatch, programs, group, hd, window, softcap, quantized):
    monkeypatch.setattr(gpu, "PROGRAMS", programs)
    kv_heads, kv_len = 2, 256
    cache = _cache(4, 320, kv_heads, hd, quantized)  # more positions than the bucket, more rows than attend
    rows = jnp.asarray([3, 0, 2])
    # the first position, one inside the first block, block edges, beyond a window, the bucket's last
    for positions in ([0, 5, 63], [64, 127, 200], [255, 130, 41]):
        positions = jnp.asarray(positions)[:, None]
        q = jax.random.normal(jax.random.key(7), (3, 1, kv_heads, group, hd)).astype(jnp.bfloat16)
        got = gpu_attention.attend(q, positions, *cache, 0, rows, kv_len, window, hd**-0.5, softcap)
        expected = _xla(q, positions, cache, rows, kv_len, window, hd**-0.5, softcap)
        assert got.shape == expected.shape == (3, 1, kv_heads, group, hd)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "T, group, window, softcap, quantized, dtype",
    [
        (25, 4, None, None, False, jnp.bfloat16),  # 100 query rows: a block of 64 and a partial one
        (5, 4, 40, 5.0, True, jnp.bfloat16),  # a speculative check: 20 rows in one block
        (70, 1, 30, None, False, jnp.float32),  # float32 in full precision, a window inside the chunk
        (40, 2, None, None, True, jnp.float32),  # int8 codes read as stored: exact to float32 rounding
    ],
)
def test_a_chunk_of_queries_attends_as_xla_does(interpret, T, group, window, softcap, quantized, dtype):
    kv_heads, kv_len, hd = 2, 256, 64
    cache = _cache(3, kv_len, kv_heads, hd, quantized, dtype=dtype)
    rows = jnp.asarray([2, 0])
    positions = jnp.asarray([[150 + t for t in range(T)], [t for t in range(T)]])  # a later chunk; a first one
    q = jax.random.normal(jax.random.key(3), (2, T, kv_heads, group, hd)).astype(dtype)
    got = gpu_attention.attend(q, positions, *cache, 0, rows, kv_len, window, hd**-0.5, softcap)
    expected = _xla(q, positions, cache, rows, kv_len, window, hd**-0.5, softcap)
    bound = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=bound, rtol=bound)


@pytest.mark.parametrize("quantized, kv_len", [(False, 200), (True, 200), (False, 40)])
def test_a_bucket_that_ends_mid_block(interpret, quantized, kv_len):
    """A context of 200 positions: its last kv bucket is the whole cache, 3 blocks of 64 and 8 keys;
    one of 40, less than a block."""
    kv_heads, hd = 2, 64
    cache = _cache(2, kv_len, kv_heads, hd, quantized)
    last = kv_len - 20
    for positions in (
        [[kv_len - 1], [kv_len - 8]],
        [[last + t for t in range(20)], [last - 10 + t for t in range(20)]],
    ):
        positions = jnp.asarray(positions)
        q = jax.random.normal(jax.random.key(5), (2, positions.shape[1], kv_heads, 4, hd)).astype(jnp.bfloat16)
        got = gpu_attention.attend(q, positions, *cache, 0, None, kv_len, None, hd**-0.5, None)
        expected = _xla(q, positions, cache, jnp.arange(2), kv_len, None, hd**-0.5, None)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-2, rtol=2e-2)


def test_keys_a_query_cannot_see_are_never_read_into_it(interpret):
    """Positions past a query's own and before its window hold huge values (what an earlier, longer
    sequence leaves): any that leaked in would dominate the answer."""
    hd, kv_len, window = 64, 512, 70
    k, v, _, _ = _cache(2, kv_len, 1, hd, False)
    positions = jnp.asarray([[100], [300]])
    at = jnp.arange(kv_len)[None, :, None, None]
    hidden = (at > positions[:, :, None, None]) | (at <= positions[:, :, None, None] - window)
    poison = lambda a: jnp.where(hidden[None], 1e4, a).astype(a.dtype)  # noqa: E731
    q = jax.random.normal(jax.random.key(1), (2, 1, 1, 4, hd)).astype(jnp.bfloat16)
    got = gpu_attention.attend(q, positions, poison(k), poison(v), None, None, 0, None, kv_len, window, 0.125, None)
    expected = _xla(q, positions, (k, v, None, None), jnp.arange(2), kv_len, window, 0.125, None)
    assert float(jnp.abs(got).max()) < 10
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-2, rtol=2e-2)


def test_one_row_splits_its_keys_until_the_programs_fill_the_gpu():
    assert gpu.split(4096 // gpu_attention.BLOCK_K, 1 * 8) == 64  # 8B shape, B=1: 8 kv heads × 64 shares of a block
    assert gpu.split(16384 // gpu_attention.BLOCK_K, 1 * 8) == 64  # a longer bucket: shares of 4 blocks
    assert gpu.split(1024 // gpu_attention.BLOCK_K, 16 * 8) == 4  # B=16: 128 programs × 4
    assert gpu.split(64 // gpu_attention.BLOCK_K, 1) == 1  # a bucket of one block stays whole


CFG = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 64, 1e-5, 256, 1e4, sliding_windows=(None, None))


def test_the_cache_says_when_the_gpu_kernel_attends(interpret):
    """Float caches of any width and int8 ones, on one device; a mesh's cache and head sizes
    Triton's tiles cannot hold stay on XLA."""
    assert KVCache.zeros(CFG, 1, 16, jnp.bfloat16).kernel == "gpu"
    assert KVCache.zeros(CFG, 1, 16, jnp.float32).kernel == "gpu"
    assert KVCache.zeros(replace(CFG, kv_dtype="int8"), 1, 16, jnp.bfloat16).kernel == "gpu"
    assert KVCache.zeros(CFG, 1, 16, jnp.bfloat16, whole=False).kernel is None
    assert KVCache.zeros(replace(CFG, head_dim=96), 1, 16, jnp.bfloat16).kernel is None


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU")
def test_off_a_gpu_the_kernel_is_not_asked():
    assert gpu.MODE is None and jax.default_backend() != "gpu"
    assert not gpu_attention.here(replace(CFG, head_dim=64), jnp.bfloat16)


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
@pytest.mark.parametrize(
    "arch, dtype, kv_dtype, chunk",
    [("gemma2", "float32", None, None), ("llama", "float32", "int8", 16), ("gpt-oss", "float32", None, 16)],
)
def test_a_model_generates_through_the_kernel_what_it_does_through_xla(tiny, monkeypatch, arch, dtype, kv_dtype, chunk):
    """Gemma 2's soft-capping and sliding window (24, passed); Llama over an int8 cache, and gpt-oss
    (attention sinks, every other layer sliding), each with its prompt (40 tokens) in chunks of 16
    over the cache: the prompt's chunks through the kernel.
    In float32 (full-precision products on both paths): in bfloat16 the running softmax rounds its
    weights apart from XLA's, and a near tie flips (Llama's int8 case at token 11); the kernel's
    bfloat16 arithmetic is held to XLA's by the tests above."""
    path = tiny(arch, head_dim=64)
    ids = [0] + [(7 * n + 3) % 300 + 2 for n in range(39)]

    def greedy() -> tuple[list[int], str | None]:
        loaded = load_model(path, dtype=dtype, kv_dtype=kv_dtype)
        engine = Engine(loaded.config, loaded.params, 128, (), Decoding(prefill_chunk=chunk))
        gen = Generation(loaded, engine, ids, Sampling(), 30)
        list(gen)
        return gen.token_ids, engine.scheduler.slots.state.cache.kernel

    monkeypatch.setattr(kernel, "enabled", False)
    monkeypatch.setattr(gpu, "MODE", "off")  # XLA's attention, on any backend
    expected, who = greedy()
    assert who is None
    monkeypatch.setattr(gpu, "MODE", "interpret" if jax.default_backend() != "gpu" else None)
    got, who = greedy()
    assert who == "gpu"
    assert got == expected


@pytest.mark.parametrize("arch, kv_dtype", [("gemma2", None), ("llama", "int8"), ("gpt-oss", None)])
def test_a_whole_sequence_without_a_cache_attends_through_the_kernel(tiny, monkeypatch, arch, kv_dtype):
    """Perplexity's forward pass (no cache: each sequence over its own 40 keys, no multiple of a
    block; Gemma 2's window and soft-capping; the int8 a cache would hold; gpt-oss's sinks) gives
    XLA's logits."""
    loaded = load_model(tiny(arch, head_dim=64), dtype="float32", kv_dtype=kv_dtype)
    tokens = jax.random.randint(jax.random.key(0), (2, 40), 2, 300)
    positions = jnp.broadcast_to(jnp.arange(40), (2, 40))

    def logits() -> np.ndarray:
        forward = jax.jit(lambda params, tokens: model.forward(params, loaded.config, tokens, positions, None, 40))
        hidden, _ = forward(loaded.params, tokens)  # a new function each time: traced anew
        return np.asarray(model.logits(loaded.params, hidden, loaded.config))

    monkeypatch.setattr(kernel, "enabled", False)
    monkeypatch.setattr(gpu, "MODE", "off")
    expected = logits()
    monkeypatch.setattr(gpu, "MODE", "interpret" if jax.default_backend() != "gpu" else None)
    # int8: the two programs quantize the keys in fusions of their own, and a code at a rounding tie
    # may land one step apart (1/127 of its head's largest); on the same codes the kernel is XLA's
    # within 1e-5 (the tests above)
    bound = 1e-2 if kv_dtype else 1e-4
    np.testing.assert_allclose(logits(), expected, rtol=bound, atol=bound * np.abs(expected).max())


@pytest.mark.parametrize(
    "quantized, softcap, T, kv_len",
    [(False, None, 1, 512), (True, 30.0, 1, 512), (False, None, 100, 512), (True, None, 4, 200)],
)
def test_the_kernel_lowers_to_triton(quantized, softcap, T, kv_len):
    """What JAX hands XLA's GPU backend: a Triton call (a bucket ending mid-block: masked loads).
    Its compilation to the GPU's code is checked where there is one (`gpu_attention._works`)."""
    k = jnp.zeros((2, 3, kv_len, 2, 128), jnp.int8 if quantized else jnp.bfloat16)
    scales = (jnp.zeros(k.shape[:-1]),) * 2 if quantized else ()
    rows = min(gpu_attention.ROWS, max(16, pl.next_power_of_2(4 * T)))
    splits = 4 if T == 1 else 1
    queries = (jnp.zeros((2, 4 * T), jnp.int32), jnp.zeros((2, 2, 4 * T, 128), jnp.bfloat16))
    args = (jnp.arange(2), jnp.ones(1, jnp.int32), *queries, k, k, *scales)
    static = dict(kv_len=kv_len, block=64, block_rows=rows, splits=splits, normalize=splits == 1, window=100, scale=0.1)
    call = lambda *a: gpu_attention._attend(*a, **static, softcap=softcap, warps=4, stages=2, interpret=False)  # noqa: E731
    assert "xla.gpu.triton" in jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_every_layer_runs_one_compiled_kernel():
    """The layer is an operand of the kernel, not a constant in it: a model's layers lower to one
    Triton kernel, which XLA compiles once (a constant would compile one per layer: 32 on the 8B shape)."""
    k = jnp.zeros((2, 1, 256, 2, 64), jnp.bfloat16)
    q, positions = jnp.zeros((1, 1, 2, 4, 64), jnp.bfloat16), jnp.zeros((1, 1), jnp.int32)

    def both(q, k):
        return [gpu_attention.attend(q, positions, k, k, None, None, i, None, 256, None, 0.125, None) for i in (0, 1)]

    text = jax.jit(both).trace(q, k).lower(lowering_platforms=("cuda",)).as_text()
    assert len(set(re.findall(r'ir = "([^"]*)"', text))) == 1
