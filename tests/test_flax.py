"""Hugging Face Flax checkpoints (`flax_model.msgpack`, what `Flax*ForCausalLM.save_pretrained` wrote
before transformers 5 dropped Flax): tiny random Llama and Gemma made and answered by transformers
4.57's own Flax models (`scripts/make_flax_fixtures.py`, tests/data/flax/), read through the one
weight table (`weights.FlaxTensors`)."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer_here
from reference import alone, assert_close, our_prompt_logits

from jaxinfer.convert import convert
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request

FIXTURES = Path(__file__).parent / "data" / "flax"


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_logits_and_greedy_text_are_the_flax_models(family, tmp_path):
    """Logits over a prompt within 1e-4·max|logit| of the Flax model's own, and its greedy 24 tokens,
    from the directory and from its orbax copy."""
    answers = np.load(FIXTURES / family / "logits.npz")
    ids = answers["ids"].tolist()
    for path in (FIXTURES / family, convert(FIXTURES / family, tmp_path / "converted")):
        model = dataclasses.replace(load_model(path), eos_ids=())
        assert_close(our_prompt_logits(model, ids)[0], answers["logits"])
        made = alone(model, Request(0, ids, Sampling(), len(answers["greedy"]), 0)).token_ids
        assert made == answers["greedy"].tolist()


def test_a_corrupt_flax_checkpoint_is_one_clear_line(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "llama", model)
    (model / "flax_model.msgpack").write_bytes((model / "flax_model.msgpack").read_bytes()[:1000])
    assert_one_line_error(jaxinfer_here("run", "-m", str(model), "hi", "-n", "2"), "flax_model.msgpack")
