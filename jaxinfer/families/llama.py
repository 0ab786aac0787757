"""Llama 2/3, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm): the Llama layout of tensors,
and the flags each architecture sets. Three more keep the layout with one twist each: SmolLM3 (no
RoPE on every fourth layer), Granite (µP multipliers on the embeddings, each block's output, the
attention scores and the logits) and Ministral 3 (Mistral's layers, YaRN, and Llama 4's attention
temperature on the queries past the original context)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, activation, common_fields
from jaxinfer.errors import JaxinferError

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    "Ministral3ForCausalLM",
)

# transformers' defaults for keys a config.json leaves out, where they differ between these.
DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128},
    "SmolLM3ForCausalLM": {
        "max_position_embeddings": 32768,
        "rope_theta": 2_000_000.0,
        "tie_word_embeddings": True,
        "no_rope_layer_interval": 4,
    },
    "GraniteForCausalLM": {"max_position_embeddings": 2048},
    "Ministral3ForCausalLM": {
        "max_position_embeddings": 262144,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
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
    twists = {}
    if arch == "SmolLM3ForCausalLM":
        twists = _smollm3(d)
    elif arch == "GraniteForCausalLM":
        twists = dict(
            embed_multiplier=float(d.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(d.get("residual_multiplier", 1.0)),
            attn_scale=float(d.get("attention_multiplier", 1.0)),
            logit_divisor=float(d.get("logits_scaling", 1.0)),
        )
    elif arch == "Ministral3ForCausalLM":
        rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
        if rope.get("llama_4_scaling_beta"):
            twists = dict(
                query_temperature=(float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"]))
            )
    return ModelConfig(
        architecture=arch,
        **common_fields(d),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm="heads" if arch == "Qwen3ForCausalLM" else "",
        **twists,
    )


def _smollm3(d: dict) -> dict:
    """SmolLM3's layers without RoPE (`no_rope_layers`: 0 where a layer takes none; by default every
    `no_rope_layer_interval`-th), and its `layer_types` where config.json leaves them out, as
    transformers makes them: sliding only where `use_sliding_window` is on, on the layers without RoPE.
    Updates `d`'s layer types in place."""
    layers = int(d["num_hidden_layers"])
    every = int(d["no_rope_layer_interval"])
    rope = d.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
    if len(rope) != layers:
        raise JaxinferError(f"config.json: no_rope_layers has {len(rope)} entries for {layers} layers")
    if d.get("layer_types") is None:
        sliding = d.get("use_sliding_window") and d.get("sliding_window") is not None
        d["layer_types"] = ["sliding_attention" if sliding and not r else "full_attention" for r in rope]
    return dict(nope_layers=tuple(i for i, r in enumerate(rope) if not r))


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """HF tensor name → (path in our tree, expected shape, logical axes). Gemma's layers share these
    names. Axes as Megatron splits a layer: q/k/v and gate/up by their outputs, o and down by their
    inputs, so a layer needs one sum across devices after each block."""
    D, V = cfg.hidden_size, cfg.vocab_size
    table = {
        "model.embed_tokens.weight": Weight(("embed",), (V, D), ("vocab", "embed")),
        "model.norm.weight": Weight(("norm",), (D,), ("embed",)),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = Weight(("lm_head",), (V, D), ("vocab", "embed"))
    for i in range(cfg.num_layers):
        F, hd = cfg.mlp_size(i), cfg.head_dim_of(i)
        q_out, kv_out = cfg.num_heads * hd, cfg.kv_heads_of(i) * hd
        own = cfg.kv_source(i) == i  # else the layer reads an earlier layer's K/V (Gemma 4), and has no k/v

        def add(hf_name: str, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> None:
            table[f"model.layers.{i}.{hf_name}"] = Weight(("layers", i, name), shape, axes)

        add("input_layernorm.weight", "attn_norm", (D,), ("embed",))
        add("post_attention_layernorm.weight", "mlp_norm", (D,), ("embed",))
        if cfg.mixer(i) == "attention":  # else the family adds its mixer's
            # with an output gate, q_proj gives each head its query, then its gate
            queries = (2 if cfg.attn_output_gate else 1) * q_out
            kv = (("k", kv_out, "kv_heads"), ("v", kv_out, "kv_heads")) if own else ()
            kv = kv[:1] if i in cfg.keys_as_values else kv  # Gemma 4: the values k_proj's too
            for proj, out, heads in (("q", queries, "heads"), *kv):
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
                if own:
                    add("self_attn.k_norm.weight", "k_norm", (hd,), (None,))
            elif cfg.qk_norm == "whole":
                add("self_attn.q_norm.weight", "q_norm", (q_out,), (None,))
                add("self_attn.k_norm.weight", "k_norm", (kv_out,), (None,))
        if cfg.feed_forward(i) == "mixture":
            continue  # the family adds its part's (beside a dense MLP: Gemma 4's, and this MLP)
        for proj, shape, axes in (
            ("gate", (F, D), ("mlp", "embed")),
            ("up", (F, D), ("mlp", "embed")),
            ("down", (D, F), ("embed", "mlp")),
        ):
            add(f"mlp.{proj}_proj.weight", f"w{proj}", shape, axes)
            if cfg.mlp_bias:
                add(f"mlp.{proj}_proj.bias", f"b{proj}", (shape[0],), axes[:1])
    return table
