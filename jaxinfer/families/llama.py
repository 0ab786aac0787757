"""Llama 2/3, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm): the Llama layout of tensors,
and the flags each architecture sets."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, activation, common_fields
from jaxinfer.errors import JaxinferError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# transformers' defaults for keys a config.json leaves out, where they differ between these.
DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128},
}


def check_silu(d: dict, arch: str) -> None:
    """Llama's blocks (and Phi-3's) run SwiGLU only."""
    if activation(d.get("hidden_act") or "silu") != "silu":
        raise JaxinferError(
            f"config.json: hidden_act {d.get('hidden_act')!r} is not supported for {arch} (only 'silu')"
        )


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS[arch], **d}
    check_silu(d, arch)
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        **common_fields(d),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm="heads" if arch == "Qwen3ForCausalLM" else "",
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """HF tensor name → (path in our tree, expected shape, logical axes). Gemma's layers share these
    names. Axes as Megatron splits a layer: q/k/v and gate/up by their outputs, o and down by their
    inputs, so a layer needs one sum across devices after each block."""
    D, F, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    table = {
        "model.embed_tokens.weight": Weight(("embed",), (V, D), ("vocab", "embed")),
        "model.norm.weight": Weight(("norm",), (D,), ("embed",)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = Weight(("lm_head",), (V, D), ("vocab", "embed"))
    for i in range(cfg.num_layers):

        def add(hf_name: str, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> None:
            table[f"model.layers.{i}.{hf_name}"] = Weight(("layers", i, name), shape, axes)

        add("input_layernorm.weight", "attn_norm", (D,), ("embed",))
        add("post_attention_layernorm.weight", "mlp_norm", (D,), ("embed",))
        if cfg.mixer(i) == "attention":  # else the family adds its mixer's
            # with an output gate, q_proj gives each head its query, then its gate
            queries = (2 if cfg.attn_output_gate else 1) * q_out
            for proj, out, heads in (("q", queries, "heads"), ("k", kv_out, "kv_heads"), ("v", kv_out, "kv_heads")):
                add(f"self_attn.{proj}_proj.weight", f"w{proj}", (out, D), (heads, "embed"))
                if cfg.qkv_bias:
                    add(f"self_attn.{proj}_proj.bias", f"b{proj}", (out,), (heads,))
            add("self_attn.o_proj.weight", "wo", (D, q_out), ("embed", "heads"))
            if cfg.o_bias:
                add("self_attn.o_proj.bias", "bo", (D,), ("embed",))
            if cfg.attn_sinks:
                add("self_attn.sinks", "sinks", (cfg.num_heads,), ("heads",))
            if cfg.qk_norm == "heads":
                add("self_attn.q_norm.weight", "q_norm", (hd,), (None,))
                add("self_attn.k_norm.weight", "k_norm", (hd,), (None,))
            elif cfg.qk_norm == "whole":
                add("self_attn.q_norm.weight", "q_norm", (q_out,), (None,))
                add("self_attn.k_norm.weight", "k_norm", (kv_out,), (None,))
        if cfg.feed_forward(i) != "dense":
            continue  # the family adds its part's
        for proj, shape, axes in (
            ("gate", (F, D), ("mlp", "embed")),
            ("up", (F, D), ("mlp", "embed")),
            ("down", (D, F), ("embed", "mlp")),
        ):
            add(f"mlp.{proj}_proj.weight", f"w{proj}", shape, axes)
            if cfg.mlp_bias:
                add(f"mlp.{proj}_proj.bias", f"b{proj}", (shape[0],), axes[:1])
    return table
