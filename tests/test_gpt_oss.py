"""gpt-oss (`jaxinfer.families.gpt_oss`): its router against transformers' own, its experts (gate and
up fused from the hub's interleaved [E, in, out] stacks, biases, the clamped SwiGLU) in every form
and plan against a float64 reference, and its attention sinks and sliding windows through chunked
prefill, a continuous batch, int8 and a mesh. Logits and greedy text against transformers are
test_parity's (the tiny gpt-oss of tiny_models: YaRN, a window of 24 the tests' sequences pass)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from kernel_helpers import xla_dot
from reference import assert_close, greedy_reference, hf_logits, our_prompt_logits, reference

from jaxinfer import forms, roofline, weights
from jaxinfer.convert import convert
from jaxinfer.forms import Experts, Packed, Quantized
from jaxinfer.layers import feed_forward
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. Def fibonacci(n): return n if n < 2 東京"
MAKERS = {
    "plain": None,
    "packed": Packed.of,
    "packed-bf16": lambda w: Packed.of(w.astype(jnp.bfloat16)),
    "int8": lambda w: Quantized.of(w, "int8"),
}


def test_the_router_picks_the_experts_transformers_picks(tiny):
    """A router with a bias, softmax over its k largest logits: the same experts in the same order
    as transformers' own router module, their weights to float32 rounding."""
    path = tiny("gpt-oss")
    hf, ours = reference(path), load_model(path)
    x = np.random.default_rng(1).standard_normal((50, ours.config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, their_weights, their_ids = hf.model.layers[1].mlp.router(torch.tensor(x))
    ids, weights = feed_forward.route(ours.params["layers"][1], jnp.asarray(x), ours.config)
    np.testing.assert_array_equal(np.asarray(ids), their_ids.numpy())
    np.testing.assert_allclose(np.asarray(weights), their_weights.numpy(), rtol=1e-5, atol=1e-7)


def test_info_counts_the_parameters_a_token_computes_with(tiny):
    """All of them (the stacks and their biases read whole), and those of the k experts a token takes."""
    path = tiny("gpt-oss")
    cfg, hf = load_model(path).config, reference(path)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for name, p in hf.named_parameters() if ".mlp.experts." in name)
    assert roofline.parameter_count(cfg) == total
    assert roofline.parameter_count(cfg, active=True) == round(total - experts + experts * 2 / 5)


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("rows", [1, 6, 40])  # the pairs plan (2 pairs), the kernels' or the tiles' (12, 80)
def test_the_experts_are_transformers_experts_in_every_form(tiny, kind, rows, isa):
    """Layer 0's experts, their stacks made into each form, on routed rows: transformers' own experts
    module on the same rows, ids and weights, within the form's rounding."""
    path = tiny("gpt-oss")
    hf, ours = reference(path), load_model(path)
    layer = dict(ours.params["layers"][0])
    for name in ("we_gate_up", "we_down"):
        dense = np.stack([np.asarray(layer[name].expert(jnp.int32(e)).dense()) for e in range(ours.config.num_experts)])
        layer[name] = (
            Experts(forms.Plain(jnp.asarray(dense)))
            if MAKERS[kind] is None
            else Experts.of(jnp.asarray(dense), MAKERS[kind])
        )
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, ours.config.hidden_size)).astype(np.float32)
    ids, weights = feed_forward.route(layer, jnp.asarray(x), ours.config)
    out = np.asarray(feed_forward.routed_mlp(layer, jnp.asarray(x), ids, weights, ours.config))
    with torch.no_grad():
        want = hf.model.layers[0].mlp.experts(
            torch.tensor(x), torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(weights))
        )
    # bfloat16 inputs and int8's W8A8 (activations quantized per block): 2.1% seen at one of 2,560 outputs
    tolerance = {"plain": 1e-5, "packed": 1e-5, "packed-bf16": 4e-2, "int8": 4e-2}[kind]
    np.testing.assert_allclose(out, want.numpy(), atol=tolerance * np.abs(want.numpy()).max())


@pytest.mark.slow
def test_chunks_a_batch_and_reused_prefixes_past_the_window_give_transformers_tokens(tiny):
    """Prompts longer than the window of 24, prefilled in chunks of 16 beside running rows and from
    another row's cached prefix: each row's greedy tokens are transformers' (sinks and windows on
    every path a row's keys take)."""
    path = tiny("gpt-oss")
    model, hf = dataclasses.replace(load_model(path), eos_ids=()), reference(path)
    # the first row ends first, and the third prompt extends its prompt
    prompts = [PROMPT, "Def fibonacci(n): return n if n < 2 else fibonacci(n - 1) 🙂", PROMPT + " and more", "東京"]
    reqs = [Request(i, model.tokenizer.encode(p), Sampling(), 6 + 6 * (i % 2), i) for i, p in enumerate(prompts)]
    out = []
    Scheduler(model, 2, 128, Decoding(16)).run(reqs, out.append, True)
    got = {r["id"]: r for r in out}
    assert got[2]["cached_tokens"] >= 24  # past the window
    for r in reqs:
        assert got[r.id]["text"] == model.tokenizer.decode(greedy_reference(hf, r.prompt_ids, r.max_tokens)), r.id


@pytest.mark.slow
def test_int8_experts_stay_close(tiny):
    """int8 on the fused gate/up and down stacks: the float model's next token at ≥ 85% of the
    prompt's positions, the logits off by ≤ 10% of their mean magnitude on average (seen: 97%, 4.0%;
    the tiny mixtral 97%, 4.2%). Not the largest error, as test_moe bounds it: where the router's
    top choices nearly tie, int8 can flip one, and that position's logits move by a quarter of their
    range (26% seen at one of 30 positions)."""
    path = tiny("gpt-oss")
    plain, int8 = load_model(path), load_model(path, quantize="int8")
    assert isinstance(int8.params["layers"][0]["we_gate_up"].inner, Quantized)
    ids = plain.tokenizer.encode(PROMPT)
    exact, quantized = our_prompt_logits(plain, ids, 128)[0], our_prompt_logits(int8, ids, 128)[0]
    assert np.mean(exact.argmax(-1) == quantized.argmax(-1)) >= 0.85
    assert np.abs(exact - quantized).mean() <= 0.1 * np.abs(exact).mean()


def as_the_hub_ships_it(path, out):
    """The tiny gpt-oss with its experts in MXFP4 as openai/gpt-oss-20b holds them: `*_blocks` [E, out,
    in/32, 16] (byte j of a block: code 2j low, 2j + 1 high) and `*_scales` [E, out, in/32], quantized
    by gguf-py's MXFP4 (llama.cpp's reference quantizer), and a quantization_config saying so."""
    import gguf
    from safetensors.numpy import load_file, save_file

    out = shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = np.swapaxes(tensors.pop(name), 1, 2)  # [E, out, in], gate and up still interleaved
        ggml = gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.MXFP4)
        ggml = ggml.reshape(*w.shape[:2], -1, 17)  # byte 0 the exponent; byte j + 1: codes j (low), j + 16
        codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], -1)
        tensors[f"{name}_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        tensors[f"{name}_scales"] = np.ascontiguousarray(ggml[..., 0])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_hubs_mxfp4_experts_are_transformers(tiny, tmp_path):
    """The hub's MXFP4 layout: held as MXFP4 (4.5 bits a weight), its values transformers' dequantized
    ones: through XLA's dot the logits within float32 rounding of transformers' on the same
    checkpoint; through the kernels (activations quantized per block, as llama.cpp's) close, the same
    next token nearly everywhere; `info`'s count of its bytes that of the loaded tree; the abstract
    tree a load compiles ahead for that tree; its orbax copy the same model."""
    import transformers

    path = as_the_hub_ships_it(tiny("gpt-oss"), tmp_path / "mxfp4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    ids = load_model(path).tokenizer.encode(PROMPT)
    theirs = hf_logits(hf, ids)
    with xla_dot():
        model = load_model(path)
        assert model.params["layers"][0]["we_gate_up"].inner.method == "mxfp4"
        assert_close(our_prompt_logits(model, ids, 128)[0], theirs)
    model = load_model(path)
    ours = our_prompt_logits(model, ids, 128)[0]
    assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= 0.9  # seen: 100%, 0.85% apart
    assert np.abs(ours - theirs).mean() <= 0.03 * np.abs(theirs).mean()
    # info counts, before loading, what the loaded tree holds: MXFP4 stacks beside float matrices
    held = roofline.weight_bytes(model.config, roofline.Storage.of_params(model.params))
    assert roofline.weight_bytes(model.config, roofline.Storage.of("float32", cfg=model.config)) == held
    assert held < 0.6 * roofline.weight_bytes(model.config, roofline.Storage.of("float32"))
    # what a load compiles ahead for, and restores into, is the tree it loads
    stored, abstract = load_model(path, layout="out_in").params, weights.abstract_params(model.config, jnp.float32)
    assert jax.tree.structure(abstract) == jax.tree.structure(stored)
    shapes = lambda tree: [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]  # noqa: E731
    assert shapes(abstract) == shapes(stored)
    converted = load_model(convert(path, tmp_path / "converted"))  # the orbax copy holds them as they are
    assert converted.params["layers"][0]["we_down"].inner.method == "mxfp4"
    np.testing.assert_array_equal(our_prompt_logits(converted, ids, 128)[0], ours)
