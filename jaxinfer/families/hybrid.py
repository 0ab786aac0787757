"""Hybrids of Gated DeltaNet and attention: Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5 / 3.6
(`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`). Three layers in four (`layer_types`) mix tokens by
a Gated DeltaNet (`jaxinfer.layers.delta_net`), whose state per row has a fixed size; the fourth by
attention whose q_proj also gives each head an output gate, with q/k RMSNorm per head and RoPE over
a quarter of each head (the text positions of Qwen3.5's mRoPE, equal on its three axes, rotate as
plain RoPE does). Every RMSNorm but the DeltaNet's gated one scales by (1 + weight). Feed-forward
parts are Qwen's: dense, or a mixture with a gated shared expert (`jaxinfer.families.moe`'s names).

The two lay out the DeltaNet's input projections differently: Qwen3-Next in two matrices whose rows
interleave q, k, v and the output gate z per key head (`in_proj_qkvz`, and b, a in `in_proj_ba`),
Qwen3.5 in four (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); the layer reads either.
The multi-token-prediction head the hub's checkpoints carry (`mtp.*`) is not used, as transformers."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, common_fields, rotary_dim
from jaxinfer.errors import JaxinferError
from jaxinfer.families import llama, moe
from jaxinfer.layers import delta_net

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
IGNORED = ("mtp.",)  # checkpoint tensors the model does not use, as transformers skips them


# transformers' defaults for keys a config.json leaves out.
_SHARED = {
    "max_position_embeddings": 32768,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}
DEFAULTS = {
    "Qwen3NextForCausalLM": {
        **_SHARED,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
    },
    "Qwen3_5ForCausalLM": {**_SHARED, "linear_num_value_heads": 32},
    "Qwen3_5MoeForCausalLM": {
        **_SHARED,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
    },
}
MIXTURES = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
MIXERS = {"linear_attention": "delta", "full_attention": "attention"}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS[arch], **d}
    llama.check_silu(d, arch)
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types") or [
        "full_attention" if (i + 1) % int(d["full_attention_interval"]) == 0 else "linear_attention"
        for i in range(layers)
    ]
    if len(types) != layers or any(t not in MIXERS for t in types):
        raise JaxinferError(f"config.json: layer_types {types} is not one {arch} runs ({', '.join(MIXERS)})")
    fields = common_fields({**d, "layer_types": ["full_attention"] * layers})
    key_heads, value_heads = int(d["linear_num_key_heads"]), int(d["linear_num_value_heads"])
    if value_heads % key_heads:
        raise JaxinferError(f"config.json: {value_heads} DeltaNet value heads do not group over {key_heads} key heads")
    mixture = {}
    if arch in MIXTURES:
        experts, top = moe.routing(d)
        mixture = dict(
            feed_forwards=moe.sparse_layers(d, layers),
            num_experts=experts,
            experts_per_token=top,
            expert_size=int(d["moe_intermediate_size"]),
            norm_topk=bool(d["norm_topk_prob"]),
            shared_expert_size=int(d["shared_expert_intermediate_size"]),
            fused_experts=bool(d.get(moe.FUSED_KEY, False)),
        )
    return ModelConfig(
        architecture=arch,
        **fields,
        qkv_bias=bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),
        qk_norm="heads",
        norm_plus_one=True,
        rotary_dim=rotary_dim(d, fields["head_dim"], DEFAULTS[arch]["partial_rotary_factor"]),
        attn_output_gate=True,
        mixers=tuple(MIXERS[t] for t in types),
        delta_heads=key_heads,
        delta_value_heads=value_heads,
        delta_key_dim=int(d["linear_key_head_dim"]),
        delta_value_dim=int(d["linear_value_head_dim"]),
        delta_conv=int(d["linear_conv_kernel_dim"]),
        # a GGUF file's (`jaxinfer.gguf_config`): llama.cpp's converter splits Qwen3-Next's in_proj_qkvz,
        # and orders Qwen3.5's value heads tiled over the key heads
        delta_qkvz=arch == "Qwen3NextForCausalLM" and not d.get("gguf_split_qkvz", False),
        delta_tiled=bool(d.get("gguf_value_heads_tiled", False)),
        **mixture,
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Qwen's mixture table (Llama's names, q_proj with each head's gate, the experts' and shared
    expert's where a layer has them), and on each DeltaNet layer its own leaves
    (`jaxinfer.layers.delta_net`), their rows grouped by key head, which a mesh splits ("delta_heads");
    a GGUF file's value heads tiled over the key heads stay whole (o's inputs keep the file's order)."""
    table = moe.weight_table(cfg) if cfg.num_experts else llama.weight_table(cfg)
    D = cfg.hidden_size
    Hk, Hv, dk, dv = cfg.delta_heads, cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim
    keys, values = Hk * dk, Hv * dv
    next_layout = cfg.architecture == "Qwen3NextForCausalLM"  # b and a interleaved in in_proj_ba
    heads = None if cfg.delta_tiled else "delta_heads"
    channels, gates, scalars = delta_net.channel_order(cfg), delta_net.value_rows(cfg, dv), delta_net.value_rows(cfg)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        if cfg.mixer(i) != "delta":
            continue

        def add(hf_name: str, name: str, shape: tuple[int, ...], axes: tuple, order=None) -> None:
            table[f"{pre}.linear_attn.{hf_name}"] = Weight(("layers", i, name), shape, axes, order=order)

        if cfg.delta_qkvz:  # already per key head
            add("in_proj_qkvz.weight", "wqkvz", (2 * keys + 2 * values, D), (heads, None))
        else:
            add("in_proj_qkv.weight", "wmix", (2 * keys + values, D), (heads, None), channels)
            add("in_proj_z.weight", "wz", (values, D), (heads, None), gates)
        if next_layout:
            add("in_proj_ba.weight", "wba", (2 * Hv, D), (heads, None))
        else:
            add("in_proj_b.weight", "wb", (Hv, D), (heads, None), scalars)
            add("in_proj_a.weight", "wa", (Hv, D), (heads, None), scalars)
        add("conv1d.weight", "conv", (2 * keys + values, 1, cfg.delta_conv), (heads, None, None), channels)
        add("A_log", "a_log", (Hv,), (heads,), scalars)
        add("dt_bias", "dt_bias", (Hv,), (heads,), scalars)
        add("norm.weight", "gate_norm", (dv,), (None,))
        add("out_proj.weight", "wo", (D, values), (None, heads))
    return table
