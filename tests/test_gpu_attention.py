"""Decode's attention kernel for GPUs (`jaxinfer.gpu_attention`) on the CPU, through Pallas'
interpreter (`gpu.MODE = "interpret"`): each row up to its own position, within its sliding window,
split over the keys, an int8 cache read as stored, soft-capping, a batch's rows picked from a larger
cache; equal to XLA's attention (`model._attend`) on the same cache, and a model generating what it
generates through XLA. That the kernel lowers to Triton is checked here too (JAX lowers for CUDA on
any machine); that it compiles and runs there, on a GPU."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import gpu, gpu_attention, kernel, model
from jaxinfer.config import ModelConfig
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kvcache import KVCache, quantize_heads
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling


@pytest.fixture
def interpret(monkeypatch):
    """The kernel through Pallas' interpreter; on a GPU, the kernel itself (Triton's)."""
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(gpu, "MODE", "interpret")
    monkeypatch.setattr(kernel, "enabled", False)  # the CPU kernel would take the cache first


def _cache(rows, length, kv_heads, hd, quantized, seed=0):
    """k, v [1, rows, length, KV, hd] (bfloat16, or int8 with scales [1, rows, length, KV])."""
    keys = jax.random.split(jax.random.key(seed), 2)
    k, v = (jax.random.normal(key, (1, rows, length, kv_heads, hd)).astype(jnp.bfloat16) for key in keys)
    if not quantized:
        return k, v, None, None
    (k, k_scale), (v, v_scale) = quantize_heads(k), quantize_heads(v)
    return k, v, k_scale, v_scale


def _xla(q, positions, cache, rows, kv_len, window, scale, softcap):
    """XLA's attention (the path the kernel replaces) over the same rows and positions."""
    read = [None if a is None else a[0][rows, :kv_len] for a in cache]
    _, total, out = model._attend(q, positions[:, None], window, scale, softcap, *read, 0)
    return out / total[..., None]


@pytest.mark.parametrize("programs", [gpu.PROGRAMS, 1])  # shares of one block each; one share of four
@pytest.mark.parametrize(
    "group, hd, window, softcap, quantized",
    [(4, 64, None, None, False), (1, 128, None, None, True), (8, 64, 40, None, False), (16, 64, 100, 5.0, True)],
)
def test_the_kernel_attends_as_xla_does(interpret, monkeypatch, programs, group, hd, window, softcap, quantized):
    monkeypatch.setattr(gpu, "PROGRAMS", programs)
    kv_heads, kv_len = 2, 256
    cache = _cache(4, 320, kv_heads, hd, quantized)  # more positions than the bucket, more rows than attend
    rows = jnp.asarray([3, 0, 2])
    # the first position, one inside the first block, block edges, beyond a window, the bucket's last
    for positions in ([0, 5, 63], [64, 127, 200], [255, 130, 41]):
        positions = jnp.asarray(positions)
        q = jax.random.normal(jax.random.key(7), (3, kv_heads, group, hd)).astype(jnp.bfloat16)
        got = gpu_attention.attend(q, positions, *cache, 0, rows, kv_len, window, hd**-0.5, softcap)
        expected = _xla(q, positions, cache, rows, kv_len, window, hd**-0.5, softcap)
        assert got.shape == expected.shape == (3, kv_heads, group, hd)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-2, rtol=2e-2)


def test_keys_a_row_cannot_see_are_never_read_into_it(interpret):
    """Positions past a row's own and before its window hold huge values (what an earlier, longer
    sequence leaves): any that leaked in would dominate the answer."""
    hd, kv_len, window = 64, 512, 70
    k, v, _, _ = _cache(2, kv_len, 1, hd, False)
    positions = jnp.asarray([100, 300])
    at = jnp.arange(kv_len)[None, :, None, None]
    hidden = (at > positions[:, None, None, None]) | (at <= positions[:, None, None, None] - window)
    poison = lambda a: jnp.where(hidden[None], 1e4, a).astype(a.dtype)  # noqa: E731
    q = jax.random.normal(jax.random.key(1), (2, 1, 4, hd)).astype(jnp.bfloat16)
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


def test_the_cache_says_when_decode_takes_the_gpu_kernel(interpret):
    """16-bit caches (float or int8) on one device; float32 (the kernel's products are 16-bit),
    a mesh's cache and head sizes Triton's tiles cannot hold stay on XLA."""
    cfg = replace(CFG, head_dim=64)
    assert KVCache.zeros(cfg, 1, 16, jnp.bfloat16).kernel == "gpu"
    assert KVCache.zeros(replace(cfg, kv_dtype="int8"), 1, 16, jnp.bfloat16).kernel == "gpu"
    assert KVCache.zeros(cfg, 1, 16, jnp.float32).kernel is None
    assert KVCache.zeros(cfg, 1, 16, jnp.bfloat16, whole=False).kernel is None
    assert KVCache.zeros(replace(cfg, head_dim=96), 1, 16, jnp.bfloat16).kernel is None
    assert KVCache.zeros(replace(cfg, num_heads=64), 1, 16, jnp.bfloat16).kernel is None  # 32 query heads a kv head


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU")
def test_off_a_gpu_the_kernel_is_not_asked():
    assert gpu.MODE is None and jax.default_backend() != "gpu"
    assert not gpu_attention.here(replace(CFG, head_dim=64), jnp.bfloat16)


@pytest.mark.parametrize("arch, kv_dtype", [("gemma2", None), ("llama", "int8")])
def test_a_model_decodes_through_the_kernel_what_it_does_through_xla(tiny, monkeypatch, arch, kv_dtype):
    """Gemma 2's soft-capping and sliding window (24, passed), Llama over an int8 cache; bfloat16."""
    path = tiny(arch, head_dim=64)
    ids = [0, 11, 42, 7, 19, 3]

    def greedy() -> tuple[list[int], str | None]:
        loaded = load_model(path, dtype="bfloat16", kv_dtype=kv_dtype)
        engine = Engine(loaded.config, loaded.params, 64, ())
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


@pytest.mark.parametrize("quantized, softcap", [(False, None), (True, 30.0)])
def test_the_kernel_lowers_to_triton(quantized, softcap):
    """What JAX hands XLA's GPU backend: a Triton call. Its compilation to the GPU's code is
    checked where there is one (`gpu_attention._works`, on first use)."""
    k = jnp.zeros((2, 3, 512, 2, 128), jnp.int8 if quantized else jnp.bfloat16)
    scales = (jnp.zeros(k.shape[:-1]),) * 2 if quantized else ()
    args = (jnp.arange(2), jnp.zeros(2, jnp.int32), jnp.zeros((2, 2, 16, 128), jnp.bfloat16), k, k, *scales)
    static = dict(layer=1, kv_len=512, block=64, share=128, window=100, scale=0.1, softcap=softcap, interpret=False)
    lowered = jax.jit(lambda *a: gpu_attention._attend(*a, **static)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()
