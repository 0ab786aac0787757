"""Model families: the config.json architectures jaxinfer runs, and for each, how its config.json
becomes a `ModelConfig` and how its tensors map onto our parameter tree.

A family is a module with `ARCHITECTURES`, `config(d, architecture)` and `weight_table(cfg)`; the
forward pass (`jaxinfer.model`) is shared, and families differ by `ModelConfig` flags and the
parts each layer is made of (`jaxinfer.layers`).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from jaxinfer.config import ModelConfig, Weight
from jaxinfer.errors import JaxinferError
from jaxinfer.families import gemma, gemma3n, gemma4, gpt_oss, hybrid, llama, moe, phi3

FAMILIES: dict[str, ModuleType] = {
    arch: module
    for module in (llama, gemma, gemma3n, gemma4, phi3, moe, hybrid, gpt_oss)
    for arch in module.ARCHITECTURES
}
# Multimodal checkpoints (a language model beside a vision tower) whose text model jaxinfer runs, as
# mlx-lm does: each → the text architecture its text_config stands for when it names no model_type
# of `TEXT_MODELS`, and transformers' default for its `tie_word_embeddings`.
TOWERS = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", True),
    "Gemma3nForConditionalGeneration": ("Gemma3nForCausalLM", True),
    "Gemma4ForConditionalGeneration": ("Gemma4ForCausalLM", True),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", True),
    "LlavaForConditionalGeneration": ("LlamaForCausalLM", False),
    "LlavaNextForConditionalGeneration": ("LlamaForCausalLM", False),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", False),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", False),
}
TEXT_MODELS = {  # a text_config's model_type → the architecture that runs it
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3n_text": "Gemma3nForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# What a multimodal checkpoint holds beside its text model: skipped (the vision tower, its projector,
# LLaVA-NeXT's image-row separator, Gemma 4's audio tower and both towers' embedders)
VISION = tuple(
    prefix + part
    for prefix in ("", "model.")
    for part in (
        "visual.",
        "vision_tower.",
        "multi_modal_projector.",
        "image_newline",
        "embed_vision.",
        "audio_tower.",
        "embed_audio.",
    )
)
# The text model's tensors as transformers 5 names them, from the names of the checkpoints written
# before it (which transformers 5 still writes on save): language_model.model.* and language_model.lm_head
LEGACY = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))
SUPPORTED_ARCHITECTURES = (*FAMILIES, *TOWERS)


def family(architecture: str) -> ModuleType:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise JaxinferError(
            f"unsupported architecture {architecture!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def config_from_hf(d: dict) -> ModelConfig:
    """Translate a Hugging Face config.json dict; reject anything this runtime cannot honour. A
    multimodal checkpoint's config is its text model's, marked as the tower's (`ModelConfig.multimodal`);
    a bare body's (`Qwen3Model`, as sentence-transformers saves one) its causal model's, headless."""
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if d.get("use_bidirectional_attention"):  # every token sees every other
        raise JaxinferError("config.json asks for bidirectional attention (EmbeddingGemma's): only causal models run")
    if arch in TOWERS:
        return replace(config_from_hf(_text_config(d, arch)), multimodal=arch)
    if arch and arch.endswith("Model") and (causal := arch.removesuffix("Model") + "ForCausalLM") in FAMILIES:
        return replace(config_from_hf({**d, "architectures": [causal]}), headless=True)
    translate = family(arch).config
    try:
        return translate(d, arch)
    except (KeyError, TypeError, ValueError) as e:
        raise JaxinferError(f"config.json is missing or has a bad value for {e}") from None


def _text_config(d: dict, arch: str) -> dict:
    """A multimodal config.json's text model as a config.json of its own. The head is tied as the
    outer config says, as transformers 5 reads it; where it says nothing, as the text config says
    (what transformers 4, which wrote those checkpoints, read: Mistral Small 3.1's text config
    unties a head its outer config leaves to a default of True), else transformers' default."""
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise JaxinferError(f"config.json: text_config of {arch} is not an object")
    default, tied = TOWERS[arch]
    kind = text.get("model_type")
    architecture = TEXT_MODELS.get(kind) if kind else default
    if architecture is None:
        raise JaxinferError(f"config.json: the text model of {arch} is a {kind!r}, which jaxinfer does not run")
    tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", tied))
    return {**text, "architectures": [architecture], "tie_word_embeddings": tie}


def tensor_name(cfg: ModelConfig, name: str) -> str:
    """A checkpoint tensor's name as `weight_table` knows it (a multimodal checkpoint's older names
    as transformers 5's; a headless body's, saved without its `model.`)."""
    if cfg.headless and not name.startswith(("model.", "lm_head.")):
        return "model." + name
    if cfg.multimodal:
        for old, new in LEGACY:
            if name.startswith(old):
                return new + name[len(old) :]
    return name


def ignored(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` is one the model does not use, as transformers skips it (a
    multi-token-prediction head), or beside the text model of a multimodal checkpoint (its vision tower)."""
    skipped = getattr(family(cfg.architecture), "IGNORED", ())
    if cfg.headless:  # a head beside an embedding model's body: never read
        skipped = (*skipped, "lm_head.")
    return name.startswith((*skipped, *VISION) if cfg.multimodal else skipped)


def note(cfg: ModelConfig) -> str | None:
    """A line to tell the user once about the checkpoint (what of it is not run), or None."""
    if cfg.multimodal:
        return f"the checkpoint's vision tower is not loaded: jaxinfer runs the text model of this {cfg.multimodal}"
    return None


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """HF tensor name → its `Weight` (path in our tree, expected shape, logical axes), as the model's
    family lays it out; a multimodal checkpoint's text model under model.language_model."""
    table = family(cfg.architecture).weight_table(cfg)
    if cfg.headless:
        table.pop("lm_head.weight", None)
    if cfg.multimodal:
        return {name.replace("model.", "model.language_model.", 1): weight for name, weight in table.items()}
    return table
