"""The text model of a multimodal checkpoint (`*ForConditionalGeneration`: a language model beside a
vision tower), as transformers builds and saves one with a random vision tower: its text answers as
transformers' multimodal model answers a text prompt, and exactly as its `*ForCausalLM` twin holding
the same language-model weights; both names of its tensors are read; an mmproj GGUF file is refused."""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from cli_helpers import assert_one_line_error, jaxinfer_here
from reference import assert_close, greedy_reference, hf_logits, our_prompt_logits
from safetensors.numpy import load_file, save_file
from tiny_models import bpe_tokenizer

from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling

PROMPT = "The capital of France is Paris. def fibonacci(n):"
TEXT = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=0,
    eos_token_id=1,
    max_position_embeddings=256,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
)
# kind → (the multimodal class, its config, the text model's CausalLM class)
TOWERS = {
    # a sliding window the prompt passes, one global layer
    "gemma3": (
        transformers.Gemma3ForConditionalGeneration,
        lambda: transformers.Gemma3Config(
            text_config=dict(TEXT, sliding_window=8, sliding_window_pattern=2, pad_token_id=None),
            vision_config=VISION,
            mm_tokens_per_image=4,
        ),
        transformers.Gemma3ForCausalLM,
    ),
    # Gemma 4's text (per-layer embeddings, shared K/V, wider full layers, and the 26B-A4B's mixture
    # beside each MLP and keys as values) beside its vision tower and the vision embedder (8 experts:
    # with 4, this random model's greedy choice is id 380, past the tokenizer's 378, which jaxinfer
    # never samples and transformers does)
    "gemma4": (
        transformers.Gemma4ForConditionalGeneration,
        lambda: transformers.Gemma4Config(
            text_config=dict(
                TEXT,
                head_dim=32,
                global_head_dim=64,
                num_hidden_layers=4,
                layer_types=["sliding_attention", "full_attention"] * 2,
                sliding_window=8,
                num_kv_shared_layers=2,
                hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=384,
                enable_moe_block=True,
                num_experts=8,
                top_k_experts=2,
                moe_intermediate_size=32,
                attention_k_eq_v=True,
                num_global_key_value_heads=1,
                pad_token_id=2,  # the multimodal model swaps image tokens for it
            ),
            vision_config=dict(VISION, num_key_value_heads=2, head_dim=16),
            audio_config=None,
        ),
        transformers.Gemma4ForCausalLM,
    ),
    # an untied head
    "mistral3": (
        transformers.Mistral3ForConditionalGeneration,
        lambda: transformers.Mistral3Config(
            text_config=dict(TEXT, model_type="mistral", sliding_window=12),
            vision_config=dict(VISION, head_dim=16),
            tie_word_embeddings=False,
        ),
        transformers.MistralForCausalLM,
    ),
    "llava": (
        transformers.LlavaForConditionalGeneration,
        lambda: transformers.LlavaConfig(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
        ),
        transformers.LlamaForCausalLM,
    ),
    # its image_newline beside the tower
    "llava-next": (
        transformers.LlavaNextForConditionalGeneration,
        lambda: transformers.LlavaNextConfig(
            text_config=dict(TEXT, model_type="qwen2"),
            vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32),
            image_grid_pinpoints=[[32, 32]],
        ),
        transformers.Qwen2ForCausalLM,
    ),
}


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    """kind → (its checkpoint's directory, transformers' model), each made once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            bpe_tokenizer(path)
            cls, config, _ = TOWERS[kind]
            torch.manual_seed(0)
            hf = cls(config())
            with torch.no_grad():  # wide enough that argmax is decisive
                for p in hf.parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.2)
            hf.eval().save_pretrained(path)
            made[kind] = path, hf
        return made[kind]

    return get


@pytest.mark.parametrize("kind", sorted(TOWERS))
def test_the_text_of_a_multimodal_checkpoint_is_transformers(towers, kind):
    path, hf = towers(kind)
    model = load_model(path)
    assert model.config.multimodal == TOWERS[kind][0].__name__
    ids = model.tokenizer.encode(PROMPT)
    assert_close(our_prompt_logits(model, ids)[0], hf_logits(hf, ids))
    engine = Engine(model.config, model.params, 128, eos_ids=())
    gen = Generation(model, engine, ids, Sampling(), max_tokens=24)
    "".join(gen)
    assert gen.token_ids == greedy_reference(hf, ids, 24)


def test_a_multimodal_checkpoint_answers_as_its_text_twin(towers, tmp_path):
    """The language model's weights saved as a `*ForCausalLM` of their own: the same logits, bit for bit,
    from the multimodal checkpoint under either name of its tensors (transformers 5 writes the older
    language_model.model.*; the hub also holds model.language_model.*)."""
    path, hf = towers("mistral3")
    twin = TOWERS["mistral3"][2](hf.config.text_config)
    twin.model.load_state_dict(hf.model.language_model.state_dict())
    twin.lm_head.load_state_dict(hf.lm_head.state_dict())
    twin_dir = tmp_path / "twin"
    twin.eval().save_pretrained(twin_dir)
    bpe_tokenizer(twin_dir)

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (renamed / name).write_bytes((path / name).read_bytes())
    tensors = load_file(path / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in tensors)
    new = {"model." + n if n.startswith(("vision_tower", "multi_modal")) else n: t for n, t in tensors.items()}
    new = {
        n.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head", "lm_head"): t
        for n, t in new.items()
    }
    save_file(new, renamed / "model.safetensors")

    logits = []
    for source in (twin_dir, path, renamed):
        model = load_model(source)
        logits.append(our_prompt_logits(model, model.tokenizer.encode(PROMPT))[0])
    np.testing.assert_array_equal(logits[1], logits[0])
    np.testing.assert_array_equal(logits[2], logits[0])


def test_the_cli_says_once_what_it_runs_of_a_multimodal_checkpoint(towers):
    path, _ = towers("gemma3")
    result = jaxinfer_here("run", "-m", path, "-n", "4", "--temp", "0", "hello")
    assert result.returncode == 0 and result.stderr.count("vision tower") == 1
    info = jaxinfer_here("info", "-m", path, "--json")
    facts = json.loads(info.stdout)
    assert facts["architecture"] == "Gemma3ForCausalLM"
    assert facts["text_model_of"] == "Gemma3ForConditionalGeneration"


def test_an_unknown_text_model_and_an_mmproj_file_are_one_line_each(towers, tmp_path):
    path, _ = towers("llava")
    odd = tmp_path / "odd"
    odd.mkdir()
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["model_type"] = "falcon"
    (odd / "config.json").write_text(json.dumps(config))
    assert_one_line_error(
        jaxinfer_here("run", "-m", odd, "hi"), "the text model of LlavaForConditionalGeneration is a 'falcon'"
    )

    mmproj = tmp_path / "mmproj-model-f16.gguf"  # as llama.cpp's converter names its --mmproj output
    writer = gguf.GGUFWriter(mmproj, "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((8, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(jaxinfer_here("run", "-m", mmproj, "hi"), "multimodal projector (mmproj) file")


def test_a_sparse_text_config_takes_transformers_defaults():
    """gemma-3-4b-it's config.json as the hub has it: its text config names only what differs from
    transformers' defaults (no vocabulary size, heads or head_dim), the tie left to the outer default."""
    from jaxinfer.families import config_from_hf

    d = dict(
        architectures=["Gemma3ForConditionalGeneration"],
        model_type="gemma3",
        mm_tokens_per_image=256,
        text_config=dict(
            hidden_size=2560,
            intermediate_size=10240,
            model_type="gemma3_text",
            num_hidden_layers=34,
            rope_scaling={"factor": 8.0, "rope_type": "linear"},
            sliding_window=1024,
        ),
        vision_config=dict(hidden_size=1152, image_size=896, model_type="siglip_vision_model", patch_size=14),
    )
    ours = config_from_hf(d)
    theirs = transformers.Gemma3Config(**{k: v for k, v in d.items() if k != "architectures"})
    text = theirs.text_config
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        text.vocab_size,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.sliding_windows == tuple(1024 if t == "sliding_attention" else None for t in text.layer_types)
    assert ours.attn_scale == text.query_pre_attn_scalar**-0.5
    assert (ours.rope_theta, ours.rope_scaling[0]) == (1e6, "linear") and ours.rope_local[0] == 1e4
