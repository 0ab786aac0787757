"""The CPU attention kernel (`kernels/attention.cc`) against XLA's attention (`model._attend`) on
the same cache: decode rows (one finished), prompt chunks read from other cache rows, sliding
windows, soft-capping, attention sinks (gpt-oss's: one a head, below and above its scores),
bfloat16 and int8 caches, 2, 3 and 4 query heads a kv head (Qwen3.5's 4 of 256, Gemma 4's 2 of
512: a decode step's scores summed four keys by four rows at once), on each code path this CPU
has. End to end, every test that compares with transformers runs on it where it is built."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import needs_kernel, xla_dot

from jaxinfer import kernel
from jaxinfer import model as M
from jaxinfer.config import ModelConfig
from jaxinfer.kvcache import KVCache, quantize_heads

L, R, S, KV, G, HD = 2, 3, 1024, 2, 3, 64


def xla_attention(q, positions, k, v, rows, layer, kv_len, window, scale, softcap, sinks, k_scale=None, v_scale=None):
    """What `model.attention` computes without the kernel: over the first kv_len keys at once."""
    keys, values, *scales = (None if a is None else a[layer][rows, :kv_len] for a in (k, v, k_scale, v_scale))
    top, total, out = M._attend(q, positions, window, scale, softcap, keys, values, *scales, 0)
    if sinks is not None:
        total, out = M.with_sinks(top, total, out, sinks.reshape(q.shape[2], q.shape[3], 1))
    return jnp.moveaxis(out / total[..., None], 3, 1)


CASES = {  # positions [B, T], cache rows, kv_len, window, softcap, sinks (their spread)
    "decode, a finished row": ([[700], [S]], [0, 2], 1024, None, None, None),
    "decode, sinks": ([[700], [5]], [0, 2], 1024, None, None, 3.0),
    "chunk over other rows": ([list(range(600, 616)), list(range(40, 56))], [2, 1], 1024, None, None, None),
    "sliding window": ([list(range(900, 964))], [1], 1024, 300, None, None),
    "sliding window, sinks": ([list(range(900, 964))], [1], 1024, 300, None, 10.0),
    "soft-capped, short bucket": ([list(range(100, 103)), list(range(3))], [0, 1], 128, None, 0.5, None),
}

# an int8 cache's: decode rows (values read as stored), a chunk (values widened once), a window with
# sinks, a short bucket
INT8_CASES = ("decode, a finished row", "chunk over other rows", "sliding window, sinks", "soft-capped, short bucket")


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])  # int8: a scale a vector (`--kv-dtype int8`)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("G, HD", [(3, 64), (4, 256), (2, 512)])  # decode rows: scores read where keys lie
def test_attention_kernel_matches_xla(isa, dtype, case, G, HD):
    if dtype == jnp.int8 and (HD == 512 or case not in INT8_CASES):
        pytest.skip("int8 shares the float paths' masks and splits: its loads and scales on fewer cases")
    positions, rows, kv_len, window, softcap, spread = CASES[case]
    positions, rows = jnp.asarray(positions, jnp.int32), jnp.asarray(rows, jnp.int32)
    k, v = (jax.random.normal(jax.random.key(i), (L, R, S, KV, HD)) for i in (0, 1))  # XLA's cache layout
    scales = (None, None)
    if dtype == jnp.int8:  # as the cache writes them, each vector's scale varied
        varied = [jnp.exp(jax.random.normal(jax.random.key(4 + i), (L, R, S, KV, 1))) for i in (0, 1)]
        (k, k_scale), (v, v_scale) = quantize_heads(k * varied[0]), quantize_heads(v * varied[1])
        scales = (k_scale, v_scale)
    k, v = k.astype(dtype), v.astype(dtype)
    q = jax.random.normal(jax.random.key(2), (*positions.shape, KV, G, HD))
    sinks = None if spread is None else spread * jax.random.normal(jax.random.key(3), (KV * G,))
    rest = (rows, 1, kv_len, window, HD**-0.5, softcap, sinks)
    # the kernel's: [L, R, KV, S, hd]; a bfloat16 cache as the CPU holds it, its bits (uint16)
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a  # noqa: E731
    kernels = [None if a is None else bits(a).swapaxes(2, 3) for a in (k, v, *scales)]
    ours = np.asarray(kernel.attention(q, positions, *kernels[:2], *rest, *kernels[2:]))
    want = np.asarray(xla_attention(q, positions, k, v, *rest, *scales))
    live = np.asarray(positions) < kv_len
    # int8: the same sums over values up to ~20 in another order (scales applied elsewhere; a wrong
    # scale misses by 0.1-1)
    np.testing.assert_allclose(ours[live], want[live], rtol=2e-5, atol=5e-5 if dtype == jnp.int8 else 2e-6)
    assert not ours[~live].any()  # a finished row's queries see nothing


@pytest.mark.skipif(
    not kernel.vectorised(), reason="the kernels take no vectorised path on this CPU (neither AVX2 nor AVX-512)"
)
def test_the_cache_says_who_attends():
    """A float or int8 cache on one device is the kernel's; a head size the kernel has no path for,
    a mesh's cache, or any cache where the kernels are off is XLA's."""
    cfg = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 64, 1e-5, 256, 1e4, sliding_windows=(None, None))
    assert KVCache.zeros(cfg, 1, 16, jnp.float32).kernel == "cpu"
    assert KVCache.zeros(replace(cfg, kv_dtype="int8"), 1, 16, jnp.float32).kernel == "cpu"
    assert KVCache.zeros(replace(cfg, head_dim=48), 1, 16, jnp.float32).kernel is None
    assert KVCache.zeros(cfg, 1, 16, jnp.float32, whole=False).kernel is None
    with xla_dot():
        assert KVCache.zeros(cfg, 1, 16, jnp.float32).kernel is None
