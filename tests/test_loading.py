"""Loading details: sharded checkpoints, generation defaults, EOS ids, dtype choice."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.loading import load_model, resolve_dtype
from jaxinfer.sampling import Sampling


def test_sharded_checkpoint_loads_the_same_weights(tiny, tmp_path):
    path = tiny("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    whole, sharded = load_model(path), load_model(tmp_path)
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generation_config_sets_defaults_and_eos_ids(tiny, tmp_path):
    model = load_model(tiny("llama"))
    assert model.sampling == Sampling() and model.eos_ids == (1,)  # no do_sample: greedy
    path = shutil.copytree(tiny("llama"), tmp_path / "model")
    (path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 7], "max_new_tokens": 50})
    )
    model = load_model(path)
    assert model.sampling == Sampling(temperature=0.6, top_k=50, top_p=0.9)  # transformers' top_k default
    assert model.eos_ids == (1, 7) and model.max_new_tokens == 50


def test_auto_dtype_never_stores_half_precision_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == "float32"
    assert resolve_dtype("auto", {"dtype": "float16"}) == "float32"
    assert resolve_dtype("bfloat16", {"dtype": "float32"}) == "bfloat16"


@pytest.mark.slow
def test_an_embedding_padded_past_the_tokenizer_never_samples_a_padding_id(tiny, tmp_path):
    from reference import greedy_reference, reference
    from safetensors.numpy import load_file, save_file

    from jaxinfer.engine import Engine
    from jaxinfer.generate import Generation

    path = shutil.copytree(tiny("llama", tokenizer="sp", vocab_size=512), tmp_path / "padded")  # 400 pieces
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"][400:] = 5 * tensors["lm_head.weight"][:112]  # the padding rows would win
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path)
    ids = model.tokenizer.encode("The capital of France is")
    assert max(greedy_reference(reference(path), ids, 8)) >= 400  # transformers samples padding ids here
    for sampling in (Sampling(), Sampling(temperature=1.5)):
        gen = Generation(model, Engine(model.config, model.params, 64, model.eos_ids), ids, sampling, 24, seed=3)
        list(gen)
        assert len(gen.token_ids) > 0 and max(gen.token_ids) < 400
    assert model.tokenizer.decode([450, 5, 511]) == model.tokenizer.decode([5])  # decoding never fails on an id


def test_checkpoints_that_cannot_be_right_are_refused(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxinfer.errors import JaxinferError

    with pytest.raises(JaxinferError, match="ids up to 399 but the embedding table has 300 rows"):
        load_model(tiny("llama", tokenizer="sp", vocab_size=300))  # a 400-piece tokenizer
    path = shutil.copytree(tiny("llama"), tmp_path / "int8")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].astype(np.int8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(JaxinferError, match="model.layers.0.mlp.up_proj.weight holds int8"):
        load_model(path)


@pytest.mark.parametrize(
    "arch, dtype, quantize", [("llama", "auto", None), ("qwen2", "bfloat16", None), ("gemma3", "auto", "int8")]
)
def test_programs_compiled_ahead_are_the_ones_the_weights_run(tiny, arch, dtype, quantize):
    """open_model's `ahead` gets the model with abstract weights while the real ones load; what
    `compile_ahead` builds for them is what the first request runs: it compiles nothing more (the
    abstract tree has the loaded tree's forms, shapes and dtypes, in its layout)."""
    from jaxinfer.engine import Engine, compile_ahead
    from jaxinfer.loading import open_model

    prompt, seen = [0, 5, 9, 13] * 5, []

    def ahead(opened):
        seen.append(jax.tree.leaves(opened.model.params)[0])
        compile_ahead(opened, prompt, 8)

    opened = open_model(tiny(arch), dtype=dtype, quantize=quantize, max_context=96, ahead=ahead)
    assert isinstance(seen[0], jax.ShapeDtypeStruct)
    model = opened.model
    tokens = Engine(model.config, model.params, opened.context, model.eos_ids, opened.decoding).generate(
        prompt, Sampling(), 8, seed=0
    )
    assert len([t for chunk in tokens for t in chunk]) == 8
    assert tokens.timings.compile.programs == 0, tokens.timings.compile
