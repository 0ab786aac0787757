"""Block quantization (`jaxinfer.quant`): the packing's error bounds, the CPU kernel against the
arithmetic it claims and against the dequantized weights, and quantized models judged by what a
user judges them by: perplexity, KL divergence and greedy agreement with float32."""

import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here
from kernel_helpers import needs_kernel, xla_dot

from jaxinfer import forms, kernel, quant
from jaxinfer.forms import Quantized
from jaxinfer.loading import load_model
from jaxinfer.perplexity import perplexity, windows

# (out, in, rows): tiles of 8 and 2 rows and their remainders; the k-quants' inputs are super-blocks of 256
SHAPES = [
    (16, 32, 1),
    (48, 96, 3),
    (160, 64, 9),
    (64, 160, 17),
    (32, 32, 8),
    (32, 64, 2),
]
K_SHAPES = [(48, 256, 1), (48, 512, 3), (32, 256, 9), (64, 768, 17), (32, 256, 2)]
K_QUANTS = [name for name, m in quant.METHODS.items() if m.kind >= 0]  # llama.cpp's scale-and-min formats


def blocks_of(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[0], -1, quant.BLOCK)


@pytest.mark.parametrize("method", quant.QUANTIZERS)
def test_quantize_error_is_within_the_block_step(method):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 128)).astype(np.float32)
    w[3, :32] = 0  # an all-zero block
    w[5, 40] = 50.0  # an outlier widens only its own block
    leaf = Quantized.of(jnp.asarray(w), method)
    back = np.asarray(leaf.dense())
    eight_bits = quant.METHODS[method].bits == 8
    ones = Quantized(jnp.ones_like(leaf.q) * (1 if eight_bits else 0x99), leaf.scale, method)
    step = np.abs(np.asarray(ones.dense()))
    step = blocks_of(step)[..., :1]  # |d| of each block (4 bits: (9 - 8) · d)
    error = np.abs(blocks_of(back - w))
    # 8 bits round to the nearest step (int8's bf16 scale may clip the largest value by under half a
    # step; q8_0 rounds by the float32 scale, then stores it float16: up to 127 · 2^-11 of a step
    # more); 4 bits put the largest magnitude on -8 exactly, so +8·d clips to 7·d: one step
    bound = (0.5 + (127 * 2**-11 if method == "q8_0" else 0)) if eight_bits else 1.0
    assert np.all(error <= bound * step * (1 + 2**-7) + 1e-7)
    assert np.all(back[3, :32] == 0)
    assert np.abs(back[5, 40] - 50) <= (0.5 if eight_bits else 50 / 8 / 2) * (1 + 2**-7)
    assert np.median(error[:, 1:]) < 0.3 * np.median(step)  # most values land well inside the bound


def test_mxfp4_values_are_gguf_s_bit_for_bit():
    """MXFP4's blocks as gguf-py quantizes floats into them (block exponents over nearly their whole
    range): their values through our packing, bit for bit gguf-py's. Not below 2^-120: XLA flushes
    subnormal floats to zero, so the values of a block whose exponent is under 3 (weights under
    1e-37) come out 0 where numpy keeps them."""
    import gguf

    from jaxinfer.gguf_model import block_arrays

    rng = np.random.default_rng(4)
    w = (rng.standard_normal((32, 256, 32)) * np.exp2(rng.integers(-120, 120, (32, 256, 1)))).reshape(32, -1)
    theirs = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    assert len(np.unique(theirs.reshape(32, 256, 17)[..., 0])) > 200
    codes, scales = block_arrays(theirs.reshape(32, 256, 17), "mxfp4")
    leaf = Quantized(*quant.pack(jnp.asarray(codes), jnp.asarray(scales), "mxfp4"), "mxfp4")
    want = gguf.quants.dequantize(theirs, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(np.asarray(leaf.dense()).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("method", ["q8_0", "q4_0"])
def test_llama_cpp_methods_are_its_own_bits(method):
    """q8_0 and q4_0 quantize as llama.cpp's reference does (the `gguf` package's port of it), bit for
    bit, and dequantize to its values: a GGUF file's blocks and ours are one format, repacked."""
    import gguf

    kind = gguf.GGMLQuantizationType[method.upper()]
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((32, 256)) * rng.uniform(0.01, 3, (32, 1))).astype(np.float32)
    w[1, :32] = 0
    leaf = Quantized.of(jnp.asarray(w), method)
    theirs = gguf.quants.quantize(w, kind)  # [32, blocks · bytes per block] uint8
    scales = theirs.reshape(32, 8, -1)[..., :2].copy().view(np.float16)[..., 0]  # each block's d
    np.testing.assert_array_equal(np.asarray(leaf.scale).transpose(0, 2, 1).reshape(32, 8), scales)
    np.testing.assert_array_equal(np.asarray(leaf.dense()), gguf.quants.dequantize(theirs, kind))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux", reason="CI's platform")
def test_the_kernel_is_built_where_ci_runs():
    assert kernel.isa() is not None, "pip install did not build jaxinfer/kernels/matmul.cc"


def problem(n, k, m, method, seed=0):
    """x [m, k] and a matrix [n, k] held by `method`: quantized from random floats, or for a k-quant
    (which jaxinfer reads, never makes) random codes and scales over their whole ranges."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0  # an all-zero activation block
    if method == "mxfp4":  # every code, exponents around real weights' (2^-12 … 2^-1) and the extremes
        codes = rng.integers(0, 16, (n, k // 32, 32))
        exponents = rng.integers(116, 127, (n, k // 32))
        exponents[:2, 0] = (0, 160)  # a subnormal scale; one far above (254 overflows float32 at 12 · 2^126)
        arrays = quant.pack(jnp.asarray(codes), jnp.asarray(quant.e8m0_scales(exponents)), method)
        return jnp.asarray(x), Quantized(*arrays, method)
    if method in K_QUANTS:
        m_ = quant.METHODS[method]
        codes = rng.integers(0, 2**m_.bits, (n, k // 32, 32))
        codes[:16, -1] = {6: 32, 5: 16 if method == "q5_0" else 0}.get(m_.bits, 0)  # an all-zero block of a group
        sub = None
        if m_.sub_scales:  # Q6_K's sub-scales are int8, the other k-quants' 6-bit
            sub = rng.integers(-128 if m_.bits == 6 else 0, 64, (n, k // 32, 2)).astype(np.int8).view(np.uint8)
            sub[:16, -1, 1] = 0  # no min either
        sup = rng.uniform(-0.02, 0.02, (n, k // m_.super_block, m_.supers)).astype(np.float16)
        if not m_.sub_scales and m_.supers == 2:
            sup[:16, -1, 1] = 0
        arrays = quant.pack_k(jnp.asarray(codes), None if sub is None else jnp.asarray(sub), jnp.asarray(sup), method)
        return jnp.asarray(x), Quantized(*arrays[:2], method, *arrays[2:])
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:16, -32:] = 0  # an all-zero weight block of a whole group
    return jnp.asarray(x), Quantized.of(jnp.asarray(w), method)


def shapes_for(method):
    return K_SHAPES if method in K_QUANTS else SHAPES


@needs_kernel
@pytest.mark.parametrize("method", quant.METHODS)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_kernel_computes_w8a8_as_stated(isa, method, shape):
    """The kernel against the same arithmetic in jnp (integer block dots exact; the float sums
    differ only in order)."""
    if shape >= len(shapes_for(method)):
        pytest.skip("fewer shapes for this method")
    n, k, m = shapes_for(method)[shape]
    x, leaf = problem(n, k, m, method)
    ours = np.asarray(jax.jit(forms.matmul)(x, leaf))
    oracle = np.asarray(quant.w8a8_reference(x, leaf.arrays, method))
    magnitude = np.abs(np.asarray(x)) @ np.abs(np.asarray(leaf.dense())).T
    np.testing.assert_array_less(np.abs(ours - oracle), 1e-6 * magnitude + 1e-6)


@needs_kernel
@pytest.mark.parametrize("method", quant.METHODS)
def test_kernel_is_the_dequantized_product_up_to_activation_rounding(method):
    """Against the pure-JAX path (float activations): each activation moves by at most half its
    block's step, max|x_block| / 254, so |error| ≤ Σ_blocks step/2 · Σ |w| over the block."""
    x, leaf = problem(160, 512 if method in K_QUANTS else 96, 5, method, seed=1)
    ours = np.asarray(forms.matmul(x, leaf))
    with xla_dot():
        plain = np.asarray(jax.jit(forms.matmul)(x, leaf))
    magnitude = np.abs(np.asarray(x)) @ np.abs(np.asarray(leaf.dense())).T
    np.testing.assert_array_less(np.abs(plain - np.asarray(x) @ np.asarray(leaf.dense()).T), 1e-6 * magnitude + 1e-5)
    half_step = np.abs(blocks_of(np.asarray(x))).max(-1) / 254  # [m, blocks]
    w_mass = np.abs(blocks_of(np.asarray(leaf.dense()))).sum(-1)  # [n, blocks]
    bound = half_step @ w_mass.T
    assert np.all(np.abs(ours - plain) <= bound * 1.001 + 1e-5)
    assert np.abs(ours - plain).max() > 0  # the kernel did quantize the activations


@pytest.mark.parametrize("method", quant.METHODS)
def test_embedding_rows_come_out_of_the_packing(method):
    x, leaf = problem(64, 256 if method in K_QUANTS else 96, 1, method)
    ids = jnp.asarray([[0, 17, 63], [5, 5, 40]])
    rows = forms.take_rows(leaf, ids, jnp.float32)
    np.testing.assert_array_equal(rows, leaf.dense()[ids])


def test_sliding_windows_score_every_token_once():
    for tokens, context, stride in [(10, 4, 2), (10, 4, 4), (9, 16, 8), (1000, 128, 37), (2, 512, 256)]:
        scored = []
        for w in windows(tokens, context, stride):
            end = min(w.start + context, tokens)
            assert end - w.start <= context and w.scored_from >= 1
            scored += range(w.start + w.scored_from, end)
        assert scored == list(range(1, tokens))


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size(tiny, tmp_path):
    """A model whose head is all zeros predicts every token with probability 1/V."""
    import shutil

    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(tiny("llama"), tmp_path / "uniform")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = np.zeros_like(tensors["lm_head.weight"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path)
    ids = list(np.random.default_rng(0).integers(0, model.config.vocab_size, 300))
    result = perplexity(model.config, model.params, ids, context=64)
    assert result["perplexity"] == pytest.approx(model.config.vocab_size, rel=1e-5)
    assert result["tokens"] == 299


@pytest.mark.slow
def test_int8_agrees_with_float32_over_the_tiny_models(tiny):
    """Greedy agreement with the prefix held fixed, over random text, ≥ 95% over the suite. The tiny
    random models' logits are nearly flat (perplexity above the vocabulary size), a far harder
    case than a trained model's (the bundled model: 99%); W8A8 measured 92–96% on each of them."""
    agreed = tokens = 0
    for arch in ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]:
        path = tiny(arch)
        full, int8 = load_model(path), load_model(path, quantize="int8")
        ids = list(np.random.default_rng(1).integers(3, full.config.vocab_size, 400))
        result = perplexity(int8.config, int8.params, ids, context=128, reference=(full.config, full.params))
        plain = perplexity(full.config, full.params, ids, context=128)
        print(arch, result)
        assert result["top1_agreement"] >= 0.9 and result["kl_divergence"] < 0.01
        assert result["perplexity"] / plain["perplexity"] == pytest.approx(1, abs=0.01)
        agreed, tokens = agreed + result["top1_agreement"] * result["tokens"], tokens + result["tokens"]
    bundled = load_model()
    ids = bundled.tokenizer.encode(Path(quant.__file__).read_text())[:2000]  # code it never trained on
    result = perplexity(
        bundled.config, load_model(quantize="int8").params, ids, context=256, reference=(bundled.config, bundled.params)
    )
    print("bundled", result)
    agreed, tokens = agreed + result["top1_agreement"] * result["tokens"], tokens + result["tokens"]
    assert agreed / tokens >= 0.95


@pytest.mark.slow
def test_bundled_model_quality_int8_and_int4():
    """The issue's bar on held-out Python text: perplexity ratio ≤ 1.01 (int8 weights, int8 KV
    cache), ≤ 1.10 (int4); greedy agreement ≥ 95% for the int8 ones. (Text the model never trained on:
    this repository's own code.)"""
    full = load_model()
    text = "\n".join(p.read_text() for p in sorted(Path(quant.__file__).parent.glob("*.py"))[:6])
    ids = full.tokenizer.encode(text)[:2000]  # the ratios as at 4000 to the third digit, in a third of the time
    plain = perplexity(full.config, full.params, ids, context=256)
    for method, bar in (("int8", 1.01), ("int4", 1.10), ("kv int8", 1.01)):
        q = load_model(kv_dtype="int8") if method == "kv int8" else load_model(quantize=method)
        result = perplexity(q.config, q.params, ids, context=256, reference=(full.config, full.params))
        print(method, plain["perplexity"], result)
        assert result["perplexity"] / plain["perplexity"] <= bar
        if method != "int4":
            assert result["top1_agreement"] >= 0.95


@pytest.mark.slow
def test_convert_stores_the_quantized_tree_and_runs_without_the_flag(tiny, tmp_path):
    path = tiny("qwen2")  # tied embedding: the quantized table is both lookup and head
    converted = tmp_path / "int8"
    assert jaxinfer("convert", path, converted, "--quantize", "int8").returncode == 0
    args = ["Hello world", "-n", "12", "--temp", "0", "--json", "--ignore-eos"]
    stored = jaxinfer("run", "-m", converted, *args)
    at_load = jaxinfer("run", "-m", path, "--quantize", "int8", *args)
    assert stored.returncode == 0, stored.stderr
    assert json.loads(stored.stdout)["token_ids"] == json.loads(at_load.stdout)["token_ids"]
    assert_one_line_error(jaxinfer_here("run", "-m", converted, "-q", "int4", "Hi"), "already stored quantized (int8)")
    assert_one_line_error(
        jaxinfer_here("convert", converted, tmp_path / "again", "-q", "int4"), "already a converted model"
    )


@pytest.mark.slow
def test_bad_quantize_flags_fail_cleanly(tiny, tmp_path):
    path = tiny("llama")
    assert_one_line_error(
        jaxinfer("run", "-m", path, "--quantize", "int3", "Hi"), "--quantize must be one of int8, int4, q8_0, q4_0"
    )
    assert_one_line_error(
        jaxinfer_here("convert", path, tmp_path / "x", "--quantize", "fp8"), "--quantize must be one of"
    )
    assert not (tmp_path / "x").exists()
    assert_one_line_error(jaxinfer_here("perplexity", "-m", path, tmp_path / "missing.txt"), "cannot read")
    assert_one_line_error(
        jaxinfer("perplexity", "-m", path, "-", "--kl"), "give --quantize, --kv-dtype or a 16-bit --dtype too"
    )
    assert_one_line_error(
        jaxinfer("run", "-m", path, "--kv-dtype", "int4", "Hi"), "--kv-dtype must be one of auto, bfloat16, int8"
    )


@pytest.mark.slow
def test_perplexity_command(tiny, tmp_path):
    path = tiny("llama")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    proc = jaxinfer("perplexity", "-m", path, text, "-c", "64", "-q", "int8", "--kl", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["quantize"] == "int8" and result["context"] == 64 and result["perplexity"] > 1
    assert 0 <= result["kl_divergence"] < 0.1 and 0.9 <= result["top1_agreement"] <= 1
    half = json.loads(
        jaxinfer("perplexity", "-m", path, text, "-c", "64", "--dtype", "bfloat16", "--kl", "--json").stdout
    )
    # against float32
    assert half["dtype"] == "bfloat16" and 0 < half["kl_divergence"] < 0.01 and half["top1_agreement"] >= 0.9
    line = jaxinfer("perplexity", "-m", path, text, "-c", "64")
    assert line.returncode == 0 and line.stdout.startswith("perplexity ") and len(line.stdout.splitlines()) == 1


# ------------------------------------------------------------------------------ int8 KV cache


def test_the_int8_cache_holds_what_info_counts(tiny):
    from dataclasses import replace

    from jaxinfer.kvcache import KVCache
    from jaxinfer.roofline import Storage, kv_bytes_per_token

    cfg = load_model(tiny("llama")).config
    int8 = replace(cfg, kv_dtype="int8")
    S = 64
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(KVCache.zeros(int8, 1, S, jnp.float32))) / S
    assert held == kv_bytes_per_token(int8, Storage(4))
    # (hd + 4) bytes a head instead of 4·hd: at this head_dim of 16, under a third of float32's,
    # and 62.5% of bfloat16's (at real head dims of 64–128: 27–26% of float32, 53–52% of bfloat16)
    assert held < kv_bytes_per_token(cfg, Storage(4)) / 3 and held <= 0.625 * kv_bytes_per_token(cfg, Storage(2))
    # a bfloat16 cache under float32 compute: half float32's bytes, held as bfloat16's bits on the CPU
    half = replace(cfg, kv_dtype="bfloat16")
    cache = KVCache.zeros(half, 1, S, jnp.float32)
    assert {a.dtype for a in cache.k + cache.v} == {
        jnp.dtype(jnp.uint16 if jax.default_backend() == "cpu" else jnp.bfloat16)
    }
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(cache)) / S
    assert held == kv_bytes_per_token(half, Storage(4)) == kv_bytes_per_token(cfg, Storage(4)) / 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, kv_dtype", [("llama", "int8"), ("mistral", "int8"), ("qwen3", "int8"), ("llama", "bfloat16")]
)
def test_decode_through_the_int8_cache_computes_what_perplexity_scores(tiny, arch, kv_dtype):
    """Tokens decoded greedily through the int8 (or bfloat16) cache (prefill in chunks, then the
    decode loop) are the argmax of the cacheless forward with the same K/V rounding, the path
    `perplexity` judges the cache by."""
    from jaxinfer import model as M
    from jaxinfer.engine import Engine
    from jaxinfer.generate import Generation
    from jaxinfer.sampling import Sampling
    from jaxinfer.slots import Decoding

    loaded = load_model(tiny(arch), kv_dtype=kv_dtype)
    prompt = loaded.tokenizer.encode("the quick brown fox jumps over the lazy dog, then over the fence " * 2)
    engine = Engine(loaded.config, loaded.params, 256, (), Decoding(32))
    gen = Generation(loaded, engine, prompt, Sampling(temperature=0.0), 24, 0, ())
    list(gen)
    out = gen.token_ids
    assert len(out) == 24
    ids = prompt + out
    hidden, _ = M.forward(
        loaded.params, loaded.config, jnp.asarray([ids[:-1]]), jnp.arange(len(ids) - 1)[None], None, len(ids) - 1
    )
    argmax = np.asarray(jnp.argmax(M.logits(loaded.params, hidden, loaded.config)[0], -1))
    assert list(argmax[len(prompt) - 1 :]) == out
    if kv_dtype == "bfloat16":  # and a prefill's logits through the cache those of K/V in 16 bits: 6e-4 of
        # max|logit| from the cacheless pass's on this model, a float32 cache's 1e-2
        from dataclasses import replace

        from reference import our_prompt_logits

        cacheless = np.asarray(M.logits(loaded.params, hidden, loaded.config)[0])
        exact = replace(loaded, config=replace(loaded.config, kv_dtype=None))
        miss = [np.abs(our_prompt_logits(m, ids[:-1], S=256)[0] - cacheless).max() for m in (loaded, exact)]
        assert miss[0] <= 2e-3 * np.abs(cacheless).max() and miss[1] > 5 * miss[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3"])  # sliding and global layers, q/k norms, a tied head
def test_quantized_batch_rows_equal_run_alone(tiny, arch):
    """W8A8 quantizes each row's activations on its own and the cache each row's K/V: a row's
    result does not depend on its batch-mates (greedy, as test_batch holds for float)."""
    from reference import alone

    from jaxinfer.sampling import Sampling
    from jaxinfer.scheduler import Request, Scheduler

    model = load_model(tiny(arch), quantize="int8", kv_dtype="int8")
    prompts = ["The capital of France is", "def fibonacci(n):", "x", "a b c d e f g h i j k l", "Hello"]
    reqs = [
        Request(i, model.tokenizer.encode(p), Sampling(temperature=0.0), 6 + 3 * i, 100 + i, ())
        for i, p in enumerate(prompts)
    ]
    out = []
    Scheduler(model, 3, 128).run(reqs, out.append, True)
    assert {r["id"]: r["text"] for r in out} == {r.id: alone(model, r).text for r in reqs}
