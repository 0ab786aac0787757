"""Model families: the config.json architectures jaxinfer runs, and for each, how its config.json
becomes a `ModelConfig` and how its tensors map onto our parameter tree.

A family is a module with `ARCHITECTURES`, `config(d, architecture)` and `weight_table(cfg)`; the
forward pass (`jaxinfer.model`) is shared, and families differ by `ModelConfig` flags and the
parts each layer is made of (`jaxinfer.layers`).
"""

from __future__ import annotations

from types import ModuleType

from jaxinfer.config import ModelConfig, Weight
from jaxinfer.errors import JaxinferError
from jaxinfer.families import gemma, gpt_oss, hybrid, llama, moe, phi3

FAMILIES: dict[str, ModuleType] = {
    arch: module for module in (llama, gemma, phi3, moe, hybrid, gpt_oss) for arch in module.ARCHITECTURES
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def family(architecture: str) -> ModuleType:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise JaxinferError(
            f"unsupported architecture {architecture!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


def config_from_hf(d: dict) -> ModelConfig:
    """Translate a Hugging Face config.json dict; reject anything this runtime cannot honour."""
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    translate = family(arch).config
    try:
        return translate(d, arch)
    except (KeyError, TypeError, ValueError) as e:
        raise JaxinferError(f"config.json is missing or has a bad value for {e}") from None


def ignored(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` is one the model's family does not use (as transformers
    skips it: a multi-token-prediction head)."""
    return name.startswith(getattr(family(cfg.architecture), "IGNORED", ()))


def note(cfg: ModelConfig) -> str | None:
    """A line to tell the user once about the checkpoint (what of it is not run), or None."""
    family_note = getattr(family(cfg.architecture), "note", None)
    return family_note(cfg) if family_note else None


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """HF tensor name → its `Weight` (path in our tree, expected shape, logical axes), as the model's
    family lays it out."""
    return family(cfg.architecture).weight_table(cfg)
