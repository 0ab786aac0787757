"""Gemma 1/2/3 (text): Llama's layout of tensors with a GeGLU MLP (gelu, tanh approximation),
RMSNorm scaling by (1 + weight), embeddings times sqrt(hidden_size) and a tied head. Gemma 2 adds
alternating sliding-window and global layers, soft-capped attention scores and logits, a
`query_pre_attn_scalar` and norms on each block's output; Gemma 3 drops the capping, adds q/k norms,
a sliding pattern and a rope base of its own for the sliding layers."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, activation, common_fields, rope_settings
from jaxinfer.errors import JaxinferError
from jaxinfer.families import llama

ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")

# transformers' defaults for keys a config.json leaves out.
_COMMON = {"head_dim": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh"}
DEFAULTS = {
    "GemmaForCausalLM": {**_COMMON, "max_position_embeddings": 8192, "hidden_act": "gelu_pytorch_tanh"},
    "Gemma2ForCausalLM": {
        **_COMMON,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma3ForCausalLM": {  # with transformers' sizes, which the hub's multimodal text configs may leave out
        **_COMMON,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
    },
}
# Gemma 3's bases when config.json names none (transformers' `default_theta`).
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS[arch], **d}
    if d.get("use_bidirectional_attention"):
        raise JaxinferError(
            f"config.json: use_bidirectional_attention (an embedding model) is not supported for {arch}"
        )
    layers = int(d["num_hidden_layers"])
    if arch != "GemmaForCausalLM" and d.get("layer_types") is None:
        # Gemma 2 alternates, sliding first; Gemma 3 makes every `sliding_window_pattern`-th layer global
        every = 2 if arch == "Gemma2ForCausalLM" else int(d.get("sliding_window_pattern") or 6)
        d["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    fields = common_fields(d)
    rope_local = ()
    if arch == "Gemma3ForCausalLM":
        full, local = rope_per_type(d)
        fields.update(rope_theta=full[0], rope_scaling=full[1])
        rope_local = local
    attention_bias = bool(d.get("attention_bias", False))
    later = arch != "GemmaForCausalLM"
    return ModelConfig(
        architecture=arch,
        **fields,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm="heads" if arch == "Gemma3ForCausalLM" else "",
        activation=_activation(d, arch),
        norm_plus_one=True,
        embed_scale=True,
        attn_scale=float(d["query_pre_attn_scalar"]) ** -0.5 if later else 0.0,
        attn_softcap=float(d.get("attn_logit_softcapping") or 0.0) if later else 0.0,
        final_softcap=float(d.get("final_logit_softcapping") or 0.0) if later else 0.0,
        sandwich_norms=later,
        rope_local=rope_local,
    )


def _activation(d: dict, arch: str) -> str:
    """As transformers reads it: Gemma 1 from `hidden_act`, where the first releases' "gelu" means
    the tanh approximation; Gemma 2/3 from `hidden_activation` alone ("gelu" is the exact one there)."""
    if arch == "GemmaForCausalLM":
        return activation(d["hidden_act"], legacy_gelu="gelu_pytorch_tanh")
    return activation(d["hidden_activation"])


def rope_per_type(d: dict) -> tuple[tuple, tuple]:
    """((theta, scaling) of the full layers, of the sliding ones) (Gemma 3, 4), from transformers 5's
    `rope_parameters` per layer type or from the keys hub checkpoints still write: `rope_theta` and
    `rope_scaling` for the full layers, `rope_local_base_freq` for the sliding ones."""
    per_type = d.get("rope_parameters") or {}
    if "full_attention" in per_type or "sliding_attention" in per_type:
        full, local = per_type.get("full_attention") or {}, per_type.get("sliding_attention") or {}
    else:
        full = {**(d.get("rope_scaling") or {}), **per_type}
        full.setdefault("rope_theta", d.get("rope_theta", GEMMA3_THETA["full_attention"]))
        local = {"rope_theta": d.get("rope_local_base_freq", GEMMA3_THETA["sliding_attention"])}
    return (
        rope_settings(full, GEMMA3_THETA["full_attention"]),
        rope_settings(local, GEMMA3_THETA["sliding_attention"]),
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Llama's names; with Gemma 2/3's norms around each block, `post_attention_layernorm` is the
    attention output's norm and `pre_feedforward_layernorm` the MLP input's."""
    table = llama.weight_table(cfg)
    if cfg.sandwich_norms:
        D = cfg.hidden_size
        for i in range(cfg.num_layers):
            for hf_name, name in (
                ("post_attention_layernorm", "post_attn_norm"),
                ("pre_feedforward_layernorm", "mlp_norm"),
                ("post_feedforward_layernorm", "post_mlp_norm"),
            ):
                table[f"model.layers.{i}.{hf_name}.weight"] = Weight(("layers", i, name), (D,), ("embed",))
    return table
