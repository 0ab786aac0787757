"""The bundled default model: a standard checkpoint that transformers runs to the same output as we do.

Its weights are trained, not random, so this is the parity test on a model whose output means
something: greedy text from several prompts token for token, and the prompt logits.
"""

import json

import pytest
import transformers
from reference import assert_close, greedy_reference, hf_logits, our_prompt_logits, reference
from safetensors import safe_open

from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.modeldir import bundled_model_dir

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

PROMPTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef list_files(path):")


@pytest.fixture(scope="module")
def bundled():
    return load_model()


def test_bundled_model_is_a_small_bf16_llama_checkpoint():
    path = bundled_model_dir()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(path / "model.safetensors"), framework="np") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    assert sum(p.stat().st_size for p in path.iterdir()) <= 30 * 2**20


def test_greedy_text_and_logits_match_transformers(bundled):
    hf = reference(bundled.path)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(bundled.path)
    for prompt in PROMPTS:
        ids = bundled.tokenizer.encode(prompt)
        assert ids == hf_tokenizer(prompt)["input_ids"]
        assert_close(our_prompt_logits(bundled, ids)[0], hf_logits(hf, ids))
        expected = greedy_reference(hf, ids, 48)  # with the model's repetition penalty, as generate applies it
        engine = Engine(bundled.config, bundled.params, 128, eos_ids=())
        gen = Generation(bundled, engine, ids, bundled.sampling, max_tokens=48)
        assert "".join(gen) == hf_tokenizer.decode(expected)
        assert gen.token_ids == expected
