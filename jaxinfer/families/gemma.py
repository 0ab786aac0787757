"""Gemma (`GemmaForCausalLM`): Llama's layout of tensors with a GeGLU MLP (gelu, tanh
approximation), RMSNorm scaling by (1 + weight), embeddings times sqrt(hidden_size), and a tied head."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, activation, common_fields
from jaxinfer.families import llama

ARCHITECTURES = ("GemmaForCausalLM",)

# transformers' GemmaConfig defaults, for keys a config.json leaves out.
DEFAULTS = {
    "head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
    "hidden_act": "gelu_pytorch_tanh",
}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        **common_fields(d),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        activation=activation(d, legacy_gelu="gelu_pytorch_tanh"),  # as transformers reads the first releases
        norm_plus_one=True,
        embed_scale=True,
    )


weight_table = llama.weight_table
