"""Gemma 4 and Gemma 3n (text): what their layers add to the house, composed with every driver.
Logits and greedy text against transformers are test_parity's ("gemma4": per-layer attention shapes,
shared K/V, double-wide MLPs, per-layer embeddings, each layer's scalar; "gemma4-moe": the 26B-A4B's
mixture beside each MLP, its full layers' values their keys' projection; "gemma3n": AltUp's streams,
LAuReL, sparse MLPs, shared K/V and per-layer embeddings)."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, jaxinfer_here
from reference import alone, greedy_reference, our_prompt_logits, reference

from jaxinfer import roofline
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kvcache import KVCache
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n): " * 3


def test_the_cache_holds_the_layers_that_keep_their_own(tiny):
    """Two groups of K/V (the sliding layers' heads of 32, the full layers' of 64), the two shared
    layers holding none and reading the last earlier layer of their type; `info` and the roofline
    count K/V once, for those layers only."""
    path = tiny("gemma4")
    cfg = load_model(path).config
    assert cfg.kv_sources == (0, 1, 2, 3, 2, 3) and cfg.cached_layers == (0, 1, 2, 3)
    cache = KVCache.zeros(cfg, 2, 64, jnp.float32)
    assert sorted(a.shape[-1] for a in cache.k) == [32, 64] and all(a.shape[0] == 2 for a in cache.k)
    assert cache.where[4] == cache.where[2] and cache.where[5] == cache.where[3]
    per_token = 2 * 2 * (2 * 32 + 2 * 64) * 4  # K and V, 2 kv heads, two layers of each width, float32
    assert roofline.kv_bytes_per_token(cfg, roofline.Storage(4)) == per_token
    # a decode step reads one row of the per-layer embeddings a token (6 layers of 8), not the table
    one, two = (roofline.decode_step_cost(cfg, roofline.Storage(4), 0, batch=b).bytes for b in (1, 2))
    assert two - one == 6 * 8 * 4 + per_token
    facts = json.loads(jaxinfer_here("info", "-m", path, "-c", "256", "--json").stdout)
    assert facts["kv_bytes_per_token"] == per_token
    assert facts["total_bytes"] == facts["stored_weight_bytes"] + 256 * per_token


def test_chunks_and_a_second_turn_are_transformers_greedy(tiny):
    """A prompt past the sliding window in chunks of 16 (in one call: test_parity's), then a chat's second turn
    reusing the first's K/V: transformers' greedy tokens each time (the shared layers reading the
    cache the earlier layers wrote)."""
    path = tiny("gemma4")
    hf, model = reference(path), load_model(path)
    engine = Engine(model.config, model.params, 256, eos_ids=(), decoding=Decoding(prefill_chunk=16))
    ids = model.tokenizer.encode(PROMPT)
    first = Generation(model, engine, ids, Sampling(), max_tokens=10)
    list(first)
    assert first.token_ids == greedy_reference(hf, ids, 10)
    follow = ids + first.token_ids + model.tokenizer.encode(" Rome is", add_special_tokens=False)
    second = Generation(model, engine, follow, Sampling(), max_tokens=8)
    list(second)
    assert second.token_ids == greedy_reference(hf, follow, 8)
    assert second.timings.cached_tokens >= len(ids)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-moe", "gemma3n"])
def test_a_batch_and_speculation_give_what_each_row_gives_alone(tiny, arch):
    """Continuous batching with chunked prompts beside running rows, and prompt-lookup speculation
    (greedy and sampled rows): each row's text as alone, drafts having been kept."""
    # weights small enough that the greedy text soon cycles, so drafts are kept (AltUp's mixing needs smaller)
    model = dataclasses.replace(load_model(tiny(arch, init_std=0.01 if arch == "gemma3n" else 0.05)), eos_ids=())
    copy = model.tokenizer.encode(
        "The capital of France is Paris. The capital of Italy is Rome. " * 3 + "The capital of"
    )
    prompts = [copy, model.tokenizer.encode(PROMPT), model.tokenizer.encode("Def fibonacci(n):")]
    reqs = [Request(i, p, Sampling(temperature=0.7 * (i % 2)), 40, i, speculate=True) for i, p in enumerate(prompts)]
    out = []
    Scheduler(model, 2, 256, Decoding(16, Speculation(draft=4))).run(reqs, out.append, True)
    records = {r["id"]: r for r in out}
    assert {i: r["text"] for i, r in records.items()} == {r.id: alone(model, r, 256).text for r in reqs}
    assert records[0]["timings"]["speculation"]["accepted"] > 0, records[0]


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-moe", "gemma3n"])
def test_perplexity_is_transformers_loss_and_int8_stays_close(tiny, arch):
    """A whole sequence without a cache (the shared layers' K/V then held for the pass, a mixture's
    tokens routed at once) scores as transformers' loss; int8 matrices (experts too) and an int8
    cache keep the next token at ≥ 85% of positions."""
    from jaxinfer.perplexity import perplexity

    path = tiny(arch)
    model, hf = load_model(path), reference(path)
    ids = model.tokenizer.encode(PROMPT)
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert perplexity(model.config, model.params, ids, context=len(ids))["nll"] == pytest.approx(loss, rel=1e-5)
    exact = our_prompt_logits(model, ids, 128)[0]
    for quantized in (load_model(path, quantize="int8"), load_model(path, kv_dtype="int8")):
        assert np.mean(exact.argmax(-1) == our_prompt_logits(quantized, ids, 128)[0].argmax(-1)) >= 0.85


def test_the_layers_shapes_are_read_as_transformers_writes_them():
    """transformers 5's per_layer_config (keys "05", "11" past nine layers) and the hub's
    global_head_dim give the full layers their wider heads."""
    import transformers

    from jaxinfer.families import config_from_hf

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4)
    theirs = transformers.Gemma4TextConfig(**shape, head_dim=16, global_head_dim=32).to_dict()
    assert "05" in theirs["per_layer_config"]
    for d in (theirs, {**shape, "model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 32}):
        cfg = config_from_hf({**d, "architectures": ["Gemma4ForCausalLM"]})
        assert cfg.head_dims == (16,) * 5 + (32,) + (16,) * 5 + (32,)


def test_a_mixture_without_its_sizes_is_one_line(tiny, tmp_path):
    """enable_moe_block with no expert count is refused by name, not a KeyError."""
    path = tiny("gemma4-moe")
    odd = tmp_path / "odd"
    odd.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (odd / name).write_bytes((path / name).read_bytes())
    config = json.loads((path / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "num_experts": None}))
    assert_one_line_error(jaxinfer_here("run", "-m", odd, "hi"), "num_experts")


def test_gemma3n_s_multimodal_checkpoint_runs_its_text(tiny, tmp_path):
    """Gemma3nForConditionalGeneration as transformers names its tensors (the text model under
    model.language_model, the vision and audio towers and their embedders beside it, skipped): the
    text model's greedy tokens. (Its vision tower needs timm to be built: the checkpoint is the text
    model's, renamed, beside stand-ins for the towers.)"""
    from safetensors.numpy import load_file, save_file

    text = tiny("gemma3n", init_std=0.05)
    tensors = {
        k.replace("model.", "model.language_model.", 1): v for k, v in load_file(text / "model.safetensors").items()
    }
    for tower in (
        "vision_tower.timm_model.conv_stem.weight",
        "audio_tower.conformer.0.weight",
        "embed_vision.w",
        "embed_audio.w",
    ):
        tensors[f"model.{tower}"] = np.ones((2, 2), np.float32)
    multimodal = tmp_path / "gemma3n-multimodal"
    multimodal.mkdir()
    save_file(tensors, multimodal / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (text / name).is_file():
            (multimodal / name).write_bytes((text / name).read_bytes())
    text_config = json.loads((text / "config.json").read_text())
    config = {"architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n", "text_config": text_config}
    (multimodal / "config.json").write_text(json.dumps(config))
    ids = load_model(text).tokenizer.encode(PROMPT)
    twin, model = (dataclasses.replace(load_model(p), eos_ids=()) for p in (text, multimodal))
    assert model.config.multimodal == "Gemma3nForConditionalGeneration"
    made = [alone(m, Request(0, ids, Sampling(), 16, 0), 256).token_ids for m in (twin, model)]
    assert made[0] == made[1] and len(made[0]) == 16
