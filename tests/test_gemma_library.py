"""Google DeepMind's gemma library's checkpoints (`jaxinfer.gemma_library`): tiny random Gemma 1, 2
and 3 made and answered by the library's own Flax modules (`scripts/make_gemma_fixtures.py`,
tests/data/gemma-library/), saved as the library saves them (FLAT as the releases, NESTED as
`gm.ckpts.save_params`), read with no config.json: the family from the directory's name, the
tokenizer.model beside the checkpoint."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer_here
from reference import alone, assert_close, our_prompt_logits

from jaxinfer.chat_template import ChatTemplate
from jaxinfer.convert import convert
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request

FIXTURES = Path(__file__).parent / "data" / "gemma-library"
FAMILIES = ["gemma-7b-tiny", "gemma2-2b-tiny", "gemma3-1b-tiny"]


def _held_to_the_library(path: Path, answers) -> None:
    ids = answers["ids"].tolist()
    model = dataclasses.replace(load_model(path), eos_ids=())
    logits = our_prompt_logits(model, ids, S=len(ids) + 8)[0]
    assert_close(logits[-len(answers["logits"]) :], answers["logits"])
    made = alone(model, Request(0, ids, Sampling(), len(answers["greedy"]), 0), context=len(ids) + 32).token_ids
    assert made == answers["greedy"].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_text_are_the_librarys(family):
    """Logits within 1e-4·max|logit| of the library's forward pass, and its greedy 24 tokens (Gemma 3's
    over a 600-token prompt, past its sliding layers' 512-key window)."""
    _held_to_the_library(FIXTURES / family, np.load(FIXTURES / family / "logits.npz"))


def test_the_checkpoint_named_directly_its_orbax_copy_and_chat(tmp_path):
    """-m the orbax directory itself finds the tokenizer beside it; `convert` keeps the tokenizer's
    settings (its BOS, the library's chat turns), so the copy runs the same; chat speaks Gemma's turns."""
    family = FIXTURES / "gemma2-2b-tiny"
    answers = np.load(family / "logits.npz")
    _held_to_the_library(family / "checkpoint", answers)
    _held_to_the_library(convert(family / "checkpoint", tmp_path / "converted"), answers)
    model = load_model(tmp_path / "converted")
    rendered = ChatTemplate.of(model).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert model.tokenizer.token_id("<end_of_turn>") in model.eos_ids


def test_the_librarys_other_layouts_read_the_same(tmp_path):
    """The same weights as a kauldron trainer's state (`params` beside the optimizer's, here with a
    multimodal model's vision weights) and STACKED (each attention type's layers on a leading axis,
    as the library's `_compat.stack_params` lays them) give the library's tokens."""
    import orbax.checkpoint as ocp
    from flax import traverse_util

    source = FIXTURES / "gemma3-1b-tiny"
    with ocp.PyTreeCheckpointer() as checkpointer:
        nested = checkpointer.restore((source / "checkpoint").resolve())
    layers = sorted((k for k in nested if k.startswith("layer_")), key=lambda k: int(k[6:]))
    flat = {k: v for k, v in traverse_util.flatten_dict(nested, sep="/").items() if not k.startswith("layer_")}
    stacked = {f"transformer/{k.rsplit('/', 1)[0]}": {k.rsplit("/", 1)[1]: v} for k, v in flat.items()}
    for i in range(6):  # the 6-layer pattern: layer j·6 + i is slice j of attention type i
        members = [traverse_util.flatten_dict(nested[name], sep="/") for name in layers[i::6]]
        for leaf in members[0]:
            head, _, last = leaf.rpartition("/")
            head, last = (leaf, "w") if leaf.startswith("mlp/") else (head, last)
            key = f"transformer/stacked_layers/attention_type_{i}/{head}"
            stacked.setdefault(key, {})[last] = np.stack([m[leaf] for m in members])
    # a multimodal Gemma 3's vision tower and projection, which the text model does not read
    vision = {"vision_encoder": {"siglip": {"w": np.ones((4, 4), np.float32)}}}
    embedder = {**nested["embedder"], "mm_input_projection": {"w": np.ones((4, 64), np.float32)}}
    trainer = {"params": {**nested, **vision, "embedder": embedder}, "step": np.int32(7)}
    for name, tree in {"stacked": stacked, "trainer": trainer}.items():
        model = tmp_path / f"gemma3-1b-{name}"
        model.mkdir()
        shutil.copy(source / "tokenizer.model", model)
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save((model / "checkpoint").resolve(), tree)
        _held_to_the_library(model, np.load(source / "logits.npz"))


def test_an_unknown_family_or_a_broken_checkpoint_is_one_clear_line(tmp_path):
    mine = tmp_path / "mine"
    shutil.copytree(FIXTURES / "gemma2-2b-tiny", mine)
    assert_one_line_error(jaxinfer_here("run", "-m", str(mine), "hi", "-n", "2"), "name its directory after")
    wrong = tmp_path / "gemma3-1b-mine"
    mine.rename(wrong)
    assert_one_line_error(jaxinfer_here("run", "-m", str(wrong), "hi", "-n", "2"), "its tree is a Gemma 2")
    right = tmp_path / "gemma2-2b-mine"
    wrong.rename(right)
    for data in (right / "checkpoint" / "d").iterdir():
        data.write_bytes(data.read_bytes()[:100])
    assert_one_line_error(jaxinfer_here("run", "-m", str(right), "hi", "-n", "2"), "checkpoint")


def test_a_hub_repository_fetches_what_it_holds(monkeypatch, tmp_path):
    """A hub id downloads the repository's safetensors; where it has none, its Flax msgpack or its
    gemma-library checkpoint (the hub's JAX Gemma repositories: the orbax folder beside tokenizer.model),
    which then loads as a local directory does."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from jaxinfer.modeldir import HUB_FILES, hub_files, model_directory

    assert hub_files(["config.json", "model.safetensors", "flax_model.msgpack"]) == HUB_FILES
    assert hub_files(["config.json", "flax_model.msgpack"]) == [*HUB_FILES, "flax_model.msgpack*"]
    listed = ["tokenizer.model", "gemma2-2b/_METADATA", "gemma2-2b/d/0a", "README.md"]
    assert hub_files(listed) == [*HUB_FILES, "gemma2-2b/*"]
    asked = []

    def snapshot_download(repo_id, local_files_only=False, allow_patterns=None, revision=None):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        asked.append(allow_patterns)
        snapshot = tmp_path / "snapshot"  # as the repository lays it out
        shutil.copytree(FIXTURES / "gemma2-2b-tiny" / "checkpoint", snapshot / "gemma2-2b")
        shutil.copy(FIXTURES / "gemma2-2b-tiny" / "tokenizer.model", snapshot)
        return str(snapshot)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo, revision=None: listed)
    snapshot = model_directory("google/gemma-2-2b-jax")
    assert asked == [[*HUB_FILES, "gemma2-2b/*"]]
    model = load_model(snapshot)
    assert model.config.architecture == "Gemma2ForCausalLM"
