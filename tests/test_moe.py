"""Mixtures of experts (`jaxinfer.layers.feed_forward`, `jaxinfer.families.moe`): the router against
transformers' own, which layers are mixtures as transformers builds them, and a mixture through
quantization, the orbax copy, a continuous batch and a mesh. Logits and greedy text against
transformers are test_parity's (the tiny mixtral, qwen2-moe, qwen3-moe and olmoe of tiny_models);
the routed product against a dense reference in every form and on every kernel path, test_forms'."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from reference import alone, assert_close, hf_logits, our_prompt_logits, reference

from jaxinfer import roofline
from jaxinfer.constrain import Constraint
from jaxinfer.convert import convert
from jaxinfer.errors import JaxinferError
from jaxinfer.families import config_from_hf
from jaxinfer.forms import Experts, Quantized
from jaxinfer.layers import feed_forward
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler

DATA = Path(__file__).parent / "data"
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. Def fibonacci(n): return n if n < 2 東京"
IDS = [5, 9, 33, 2, 17, 80, 4, 61]


def test_tiles_hold_about_half_the_pairs_an_expert_gets():
    assert [feed_forward.tile_rows(p, 64) for p in (24, 128, 512, 2048, 4096, 8192, 65536)] == [4, 4, 4, 16, 32, 64, 64]


ROUTERS = {"mixtral": "MixtralTopKRouter", "qwen2-moe": "Qwen2MoeTopKRouter", "olmoe": "OlmoeTopKRouter"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe"])
def test_the_router_picks_the_experts_transformers_picks(tiny, arch):
    """Our router and transformers' own on the same hidden states: the same experts in the same order,
    and their weights (renormalised or not, as the family does) to float32 rounding."""
    path = tiny(arch)
    hf, ours = reference(path), load_model(path)
    i = ours.config.feed_forwards.index("mixture")
    x = np.random.default_rng(1).standard_normal((50, ours.config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, their_weights, their_ids = hf.model.layers[i].mlp.gate(torch.tensor(x))
    ids, weights = feed_forward.route(ours.params["layers"][i], jnp.asarray(x), ours.config)
    np.testing.assert_array_equal(np.asarray(ids), their_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), their_weights.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "qwen3.5-moe"])
def test_experts_stored_as_transformers_5_holds_them_read_as_per_expert_tensors(tiny, arch, tmp_path):
    """A checkpoint holding each layer's experts as two stacks under transformers 5's names (the hub's
    Qwen3.5-35B-A3B; Mixtral's block then named mlp), written from the model's own state dict: what
    transformers reads from it, our logits give, from the directory (and, one of them, its orbax copy)."""
    from safetensors.torch import save_file

    source, fused = tiny(arch), tmp_path / "fused"
    hf = reference(source)
    fused.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hf.state_dict())
    theirs = hf_logits(reference(fused), IDS)
    for path in (fused, *([convert(fused, tmp_path / "converted")] if arch == "qwen3-moe" else [])):
        model = load_model(path)
        assert model.config.fused_experts
        assert_close(our_prompt_logits(model, IDS)[0], theirs)


@pytest.mark.parametrize(
    "settings",
    [
        dict(model_type="qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6),
        dict(model_type="qwen3_moe", mlp_only_layers=[0], num_hidden_layers=3, norm_topk_prob=True),
        dict(model_type="mixtral", num_hidden_layers=2),
        dict(model_type="olmoe", num_hidden_layers=2, clip_qkv=8.0),
    ],
)
def test_each_layer_holds_the_part_transformers_builds(settings):
    """Which layers are mixtures, and the mixture's sizes and flags, as transformers reads the same
    config.json (its defaults where the file leaves keys out)."""
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    theirs = transformers.AutoConfig.for_model(**shape, **settings)
    arch = transformers.AutoModelForCausalLM.from_config(theirs).__class__.__name__
    d = {**theirs.to_dict(), "architectures": [arch]}
    ours = config_from_hf(d)
    model = transformers.AutoModelForCausalLM.from_config(theirs)
    sparse = ["mixture" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]
    assert list(ours.feed_forwards) == sparse
    layer = model.model.layers[sparse.index("mixture")].mlp
    assert ours.num_experts == layer.gate.num_experts and ours.experts_per_token == layer.gate.top_k
    assert ours.expert_size == layer.experts.down_proj.shape[-1]
    assert ours.norm_topk == getattr(layer.gate, "norm_topk_prob", True)
    shared = layer.shared_expert.down_proj.in_features if hasattr(layer, "shared_expert") else 0
    assert ours.shared_expert_size == shared
    assert ours.clip_qkv == (getattr(theirs, "clip_qkv", None) or 0.0)


def test_a_mixture_jaxinfer_cannot_run_is_one_clear_line():
    d = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=6)
    d.update(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(JaxinferError, match="6 experts per token of 4"):
        config_from_hf(d)


def test_info_counts_the_parameters_a_token_computes_with(tiny):
    """All of them, and those of the k experts a token takes (plus everything that is not an expert)."""
    cfg = load_model(tiny("qwen2-moe")).config
    hf = reference(tiny("qwen2-moe"))
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for name, p in hf.named_parameters() if ".mlp.experts." in name)
    assert roofline.parameter_count(cfg) == total
    assert roofline.parameter_count(cfg, active=True) == round(total - experts + experts * 3 / 6)


def test_a_pass_counts_the_experts_its_tokens_picked_as_transformers_routes_them(tiny):
    """The bytes a step reads count the distinct experts its tokens picked (`KVCache.experts_read`):
    over a prompt's pass, each mixture layer's union of transformers' top k, summed (the dense layer
    of this qwen2-moe counting none); a decode step of one row, k a layer; and the roofline reads
    the count as the share of the experts' bytes."""
    path = tiny("qwen2-moe")
    model, hf = load_model(path), reference(path)
    cfg, ids = model.config, model.tokenizer.encode(PROMPT)[:4]  # 5 of its 6 experts: neither k nor all
    with torch.no_grad():
        routers = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    assert len(routers) == len(cfg.mixture_layers) < cfg.num_layers
    picked = [len(np.unique(r.topk(cfg.experts_per_token, -1).indices.numpy())) for r in routers]
    assert all(cfg.experts_per_token < n < cfg.num_experts for n in picked)
    assert int(our_prompt_logits(model, ids)[1].experts_read) == sum(picked)
    timings = alone(model, Request(0, ids, Sampling(), 12, 0)).timings
    assert timings.experts_a_pass == cfg.experts_per_token * len(cfg.mixture_layers)
    storage = roofline.Storage.of_params(model.params)
    one_row = roofline.decode_step_cost(cfg, storage, 64, batch=1).bytes
    assert roofline.decode_step_cost(cfg, storage, 64, batch=1, experts=timings.experts_a_pass).bytes == one_row
    every = roofline.decode_step_cost(cfg, storage, 64, batch=1, experts=cfg.num_experts * len(cfg.mixture_layers))
    assert every.bytes > one_row


@pytest.mark.slow
def test_a_quantized_mixture_stays_close_and_survives_the_orbax_copy(tiny, tmp_path):
    """int8 on the experts' stacks (each expert quantized, `Experts(Quantized)`): over a prompt, the
    next token the float model's at ≥ 85% of positions and the logits within 10% of their range (the
    tiny dense llama: 89%, 5.1%; this mixture 96%, 4.7%), and the converted copy giving the same
    tokens as the model it was converted from."""
    path = tiny("qwen2-moe")
    plain, int8 = load_model(path), load_model(path, quantize="int8")
    layer = int8.params["layers"][1]
    assert isinstance(layer["we_gate"], Experts) and isinstance(layer["we_gate"].inner, Quantized)
    ids = plain.tokenizer.encode(PROMPT)
    exact, quantized = our_prompt_logits(plain, ids, 128)[0], our_prompt_logits(int8, ids, 128)[0]
    assert np.mean(exact.argmax(-1) == quantized.argmax(-1)) >= 0.85
    assert np.abs(exact - quantized).max() <= 0.1 * np.abs(exact).max()
    request = Request(0, ids, Sampling(), 16, 0)
    converted = load_model(convert(path, tmp_path / "int8", quantize="int8"))
    tokens = alone(dataclasses.replace(int8, eos_ids=()), request).token_ids
    assert alone(dataclasses.replace(converted, eos_ids=()), request).token_ids == tokens


@pytest.mark.slow
def test_a_batch_of_mixture_rows_gives_what_each_row_gives_alone(tiny):
    """Continuous batching with rows routed to different experts (the tiles plan: 2 experts × up to 5
    rows a step) and prompts prefilled beside running rows, one of them constrained: each free row's
    text as alone, the constrained one's a choice it was given."""
    model = dataclasses.replace(load_model(tiny("mixtral")), eos_ids=())
    prompts = ["The capital of France is", "Def fibonacci(n):", "東京は日本の", "Emoji 🙂 and", "x", "ünïcödé"]
    reqs = [Request(i, model.tokenizer.encode(p), Sampling(), 6 + 5 * (i % 3), i) for i, p in enumerate(prompts)]
    choice = Constraint("choice", ("yes", "no", "maybe so"))
    asked = Request(6, model.tokenizer.encode("Answer:"), Sampling(), 8, 6, constraint=choice)
    out = []
    scheduler = Scheduler(model, 5, 128)
    scheduler.slots.constrain(model.tokenizer)
    scheduler.run([*reqs[:3], asked, *reqs[3:]], out.append, True)
    texts = {r["id"]: r["text"] for r in out}
    assert texts.pop(6) in choice.value
    assert texts == {r.id: alone(model, r).text for r in reqs}


@pytest.mark.slow
def test_mixtures_over_devices_give_one_devices_tokens(tiny):
    """Over 2 CPU devices (in a process of their own: `tests/sharded.py`), each expert split by its
    hidden units as a dense MLP (qwen3-moe's 8 experts, olmoe's 7, never by expert), Gemma 4's gate
    and up (fused: no such axis) whole beside its down split; its full layers' one kv head whole on
    each device beside the sliding layers' two split; gpt-oss's stacks whole (its table names no
    hidden-units axis) beside its heads split with their sinks; a Q8_0 Mixtral's blocks whole on each
    device (the CPU kernel's call takes whole stacks): the tokens one device gives, each device
    holding what info counts."""
    paths = [str(tiny(arch)) for arch in ("qwen3-moe", "olmoe")] + [
        str(tiny("gemma4-moe", init_std=0.05)),
        str(tiny("gpt-oss")),
        str(DATA / "gguf" / "mixtral-sp.Q8_0.gguf"),
    ]
    script = Path(__file__).with_name("sharded.py")
    done = subprocess.run([sys.executable, script, "--experts", *paths], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    inside = {
        "we_gate": "P(None, 'tensor', None)",
        "we_up": "P(None, 'tensor', None)",
        "we_down": "P(None, None, 'tensor')",
    }
    fused = {"we_gate_up": "P(None, None, None)", "we_down": "P(None, None, 'tensor')"}
    whole = {"we_gate_up": "P(None, None, None)", "we_down": "P(None, None, None)"}
    kernels = {name: f"P({', '.join(['None'] * 6)})" for name in ("we_gate", "we_up", "we_down")}  # blocks, whole
    for path, specs in zip(paths, (inside, inside, fused, whole, kernels)):
        one, two = result[path]["1"], result[path]["2"]
        assert two["run"] == one["run"] and len(set(one["run"])) > 3
        assert two["specs"] == specs
        assert two["held"] == two["counted"] and one["held"] == one["counted"]
        assert two["held"] < one["held"] or specs is kernels
