"""Every architecture against transformers on the same weights: prefill logits, each decode step's
logits, and greedy generation token for token, from safetensors and from the orbax-converted copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from reference import assert_close, greedy_reference, hf_logits, our_prompt_logits, reference
from tiny_models import ARCHITECTURES

from jaxinfer import forms, kernel
from jaxinfer import model as M
from jaxinfer.convert import convert
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kvcache import KVCache
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling

PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n):"


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_prefill_and_every_decode_step_match_transformers(tiny, arch):
    path = tiny(arch)
    hf, ours = reference(path), load_model(path)
    ids = ours.tokenizer.encode(PROMPT)
    steps, S = 24, 64  # steps go past mistral's sliding window of 24
    logits, cache = our_prompt_logits(ours, ids, S)
    # one compiled step (op by op, a step dispatched hundreds of programs: 2-3× the whole test's time)
    step = jax.jit(lambda params, token, pos, cache: M.forward(params, ours.config, token, pos, cache, S))
    prompt_logits = hf_logits(hf, ids)
    assert_close(logits, prompt_logits)
    ref = prompt_logits[-1]

    for _ in range(steps):  # feed greedy tokens one at a time through the cache
        ids.append(int(ref.argmax()))
        pos = jnp.asarray([[len(ids) - 1]])
        hidden, cache = step(ours.params, jnp.asarray([[ids[-1]]]), pos, cache)
        ref = hf_logits(hf, ids)[-1]  # transformers' whole sequence again: its last logits, then its next token
        assert_close(np.asarray(M.logits(ours.params, hidden, ours.config))[0, 0], ref)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_generation_matches_transformers(tiny, arch, tmp_path):
    path = tiny(arch)
    hf = reference(path)
    # the orbax copy: where the tree's names differ (biases, q/k norms, four norms a layer, fused matrices,
    # stacks of experts beside a dense layer, a DeltaNet's leaves, sinks and experts' biases, per-layer embeddings,
    # a router's scales, AltUp's and LAuReL's leaves)
    differ = (
        "llama-linear",
        "qwen3",
        "gemma2",
        "phi3",
        "qwen2-moe",
        "qwen3-next",
        "gpt-oss",
        "gemma4",
        "gemma4-moe",
        "gemma3n",
    )
    converted = [convert(path, tmp_path / "converted")] if arch in differ else []
    expected = None
    for source in (path, *converted):
        model = load_model(source)
        ids = model.tokenizer.encode(PROMPT)
        expected = expected or greedy_reference(hf, ids, 32)
        engine = Engine(model.config, model.params, 128, eos_ids=())  # no EOS: always 32 tokens
        gen = Generation(model, engine, ids, Sampling(), max_tokens=32)
        text = "".join(gen)
        assert gen.token_ids == expected
        assert text == model.tokenizer.decode(expected)


@pytest.mark.parametrize("arch", ["olmoe", "qwen3.5"])
def test_perplexity_is_transformers_loss(tiny, arch):
    """A whole sequence without a cache (`jaxinfer perplexity`): the mean negative log-likelihood is
    transformers' loss on the same tokens. A mixture routes every token at once (the tiles plan); a
    hybrid's DeltaNet layers start from an empty state."""
    from jaxinfer.perplexity import perplexity

    path = tiny(arch)
    model, hf = load_model(path), reference(path)
    ids = model.tokenizer.encode(PROMPT)
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert perplexity(model.config, model.params, ids, context=len(ids))["nll"] == pytest.approx(loss, rel=1e-5)


def test_longrope_chat_turn_past_the_original_context_matches_transformers(tiny):
    """A first turn inside longrope's original context of 48 (short factors), a second that passes
    it: transformers runs the whole conversation with the long factors, and so do we: the cached
    short-factor keys are not reused."""
    path = tiny("phi3-longrope")
    hf, model = reference(path), load_model(path)
    engine = Engine(model.config, model.params, 128, eos_ids=())
    ids = model.tokenizer.encode(PROMPT)
    first = Generation(model, engine, ids, Sampling(), max_tokens=8)
    list(first)
    follow = ids + first.token_ids + model.tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(ids) + 8 < 48 < len(follow)
    again = Generation(model, engine, follow, Sampling(), max_tokens=8)
    list(again)
    assert first.token_ids == greedy_reference(hf, ids, 8) and again.token_ids == greedy_reference(hf, follow, 8)
    assert again.timings.cached_tokens == 0
    longer = follow + again.token_ids + model.tokenizer.encode(" Rome", add_special_tokens=False)
    third = Generation(model, engine, longer, Sampling(), max_tokens=8)  # long keys, reused
    list(third)
    assert third.timings.cached_tokens > 48 and third.token_ids == greedy_reference(hf, longer, 8)


def test_gemma3_config_in_the_hubs_older_keys_matches_transformers(tiny, tmp_path):
    """The same Gemma 3 weights with config.json as hub checkpoints still write it (rope_theta,
    rope_local_base_freq, sliding_window_pattern, rope_scaling, torch_dtype; no layer_types nor
    per-type rope_parameters): transformers' logits, and the model the newer keys describe."""
    import json
    import shutil

    newer = tiny("gemma3")
    older = tmp_path / "older"
    shutil.copytree(newer, older)
    config = json.loads((newer / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("layer_types")
    config["torch_dtype"] = config.pop("dtype", "float32")
    full = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    config.update(
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        sliding_window_pattern=2,
        rope_scaling=full,
    )
    (older / "config.json").write_text(json.dumps(config))
    ours = load_model(older)
    assert ours.config == load_model(newer).config
    ids = ours.tokenizer.encode(PROMPT)
    assert_close(our_prompt_logits(ours, ids)[0], hf_logits(reference(older), ids))


@pytest.mark.slow
def test_sentencepiece_model_matches_transformers(tiny):
    path = tiny("llama", tokenizer="sentencepiece")
    hf, model = reference(path), load_model(path)
    ids = model.tokenizer.encode(PROMPT)
    assert ids == transformers.AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    engine = Engine(model.config, model.params, 128, eos_ids=())
    gen = Generation(model, engine, ids, Sampling(), max_tokens=16)
    list(gen)
    assert gen.token_ids == greedy_reference(hf, ids, 16)


@pytest.mark.parametrize("arch, dtype", [("llama", "bfloat16"), ("llama", "float16"), ("gemma", "bfloat16")])
def test_half_precision_checkpoint_loads_and_follows_transformers(tiny, arch, dtype):
    """A checkpoint stored in 16 bits, computed in float32 (auto on CPU): same logits as transformers
    running the same 16-bit weights in float32. Where the CPU kernel is built, bfloat16 weights stay
    bfloat16 (it widens them exactly as it reads them); elsewhere they are stored float32. Gemma:
    its (1 + weight) norms and sqrt(hidden) embedding scale from 16-bit weights."""
    path = tiny(arch, dtype=dtype)
    model = load_model(path)
    kept = dtype == "bfloat16" and kernel.vectorised()
    assert model.dtype == (dtype if kept else "float32") and M.compute_dtype(model.params) == jnp.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = model.tokenizer.encode(PROMPT)
    assert_close(our_prompt_logits(model, ids)[0], hf_logits(hf, ids))
    stored = load_model(path, dtype)  # kept in 16 bits: runs, and stays near
    ref = hf_logits(hf, ids)
    assert np.abs(our_prompt_logits(stored, ids)[0] - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.slow
def test_asked_bfloat16_rounds_every_products_inputs(tiny):
    """`--dtype bfloat16` asked for takes each product's inputs rounded to bfloat16, sums in float32
    (as transformers' bfloat16 and llama.cpp's f16 run; AMX then needs one pass, not two); `auto` on
    the same checkpoint keeps float32's products. Rounded alike on every path: a prompt's logits in
    one pass (its 19 rows on AMX where the CPU has it) and in pieces of 5 rows (FMAs) agree to float32
    rounding, where the rounding itself moves them 100 times further."""
    path = tiny("llama", dtype="bfloat16")
    auto, asked = load_model(path), load_model(path, "bfloat16")
    assert (auto.config.matmul_inputs, asked.config.matmul_inputs) == ("float32", "bfloat16")
    if kernel.vectorised():
        assert asked.storage == "bfloat16, float32 compute, bfloat16 matmul inputs"
    ids = asked.tokenizer.encode(PROMPT)
    assert len(ids) >= 16
    whole, _ = our_prompt_logits(asked, ids)
    cache, pieces = KVCache.zeros(asked.config, 1, 64, M.compute_dtype(asked.params)), []
    for at in range(0, len(ids), 5):
        piece = jnp.asarray([ids[at : at + 5]])
        hidden, cache = M.forward(asked.params, asked.config, piece, at + jnp.arange(piece.shape[1])[None], cache, 64)
        pieces.append(np.asarray(M.logits(asked.params, hidden, asked.config))[0])
    pieces = np.concatenate(pieces)
    assert_close(pieces, whole)
    unrounded, _ = our_prompt_logits(auto, ids)
    assert np.abs(unrounded - whole).max() > 100 * max(np.abs(pieces - whole).max(), 1e-7)


@pytest.mark.parametrize("layout", ["in_out", "packed"])
@pytest.mark.parametrize("arch", ["llama-linear", "qwen3"])  # biases; q/k norms and a tied head
def test_every_layout_gives_the_same_logits(tiny, arch, layout):
    """The checkpoint's [out, in], transposed for XLA's batched dot, packed for the CPU kernel (the
    embedding too where its rows divide by 16: qwen3's padded to 400): the same model, to float32 rounding."""
    path = tiny(arch, **({"vocab_size": 400} if arch == "qwen3" else {}))
    plain, other = load_model(path, layout="out_in"), load_model(path, layout=layout)
    layer = other.params["layers"][0]
    if layout == "in_out":
        assert isinstance(layer["wq"], forms.Transposed) and isinstance(other.params["embed"], forms.Plain)
    else:
        assert isinstance(layer["wq"], forms.Packed)
        packed_embed = isinstance(other.params["embed"], forms.Packed)
        assert packed_embed == (other.config.vocab_size % 16 == 0) == (arch == "qwen3")
    ids = plain.tokenizer.encode(PROMPT)
    assert_close(our_prompt_logits(other, ids)[0], our_prompt_logits(plain, ids)[0])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_forward_without_cache_equals_cached_prefill(tiny, arch):
    """Training runs `forward` with no cache; it must be the model `run` executes (mistral: its
    sliding window of 24 is shorter than the sequence)."""
    model = load_model(tiny(arch))
    ids = model.tokenizer.encode(PROMPT * 2)
    hidden, cache = M.forward(
        model.params, model.config, jnp.asarray([ids]), jnp.arange(len(ids))[None], None, len(ids)
    )
    assert cache is None
    assert_close(np.asarray(M.logits(model.params, hidden, model.config))[0], our_prompt_logits(model, ids)[0])


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen3"])
def test_fused_attention_of_a_fresh_prompt_matches_transformers(tiny, arch, monkeypatch):
    """What a GPU runs for a prompt from its start (`model.flash`: cuDNN's flash attention through
    jax.nn.dot_product_attention), through the same call's XLA implementation: causal over its own
    keys, grouped-query heads, sliding windows, a scale ≠ 1/√head_dim; with a cache and without."""
    path = tiny(arch)
    hf, ours = reference(path), load_model(path)
    cfg, params = ours.config, ours.params
    monkeypatch.setattr(M, "FLASH", "xla")
    assert all(M.flash(cfg, jnp.float32, i) == "xla" for i in range(cfg.num_layers))
    ids = ours.tokenizer.encode(PROMPT * 3)
    assert len(ids) > 2 * max(w or 0 for w in cfg.sliding_windows)  # past every window
    tokens, positions = jnp.asarray([ids]), jnp.arange(len(ids))[None]
    cache = KVCache.zeros(cfg, 1, 128, M.compute_dtype(params))
    (hidden,), _ = M.forward_blocks(params, cfg, [M.Block(tokens, positions, len(ids), fresh=True)], cache)
    expected = hf_logits(hf, ids)
    assert_close(np.asarray(M.logits(params, hidden, cfg))[0], expected)
    hidden, _ = M.forward(params, cfg, tokens, positions, None, len(ids))
    assert_close(np.asarray(M.logits(params, hidden, cfg))[0], expected)
