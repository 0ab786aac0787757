"""gpt-oss: Llama's attention with biases and a learned sink logit per head, sliding-window layers
(128 tokens) alternating with full ones, YaRN rope, and a mixture on every layer whose router has a
bias and whose experts (a fused gate/up with biases, a clamped SwiGLU) are stored as whole stacks:
transformers' layout, [E, in, out] with gate and up interleaved (`config.Weight.stored`)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, common_fields
from jaxinfer.errors import JaxinferError
from jaxinfer.families import llama, moe

ARCHITECTURES = ("GptOssForCausalLM",)

# transformers' GptOssConfig defaults for the keys a config.json may leave out
DEFAULTS = {
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "head_dim": 64,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_limit": 7.0,
    "rope_theta": 150000.0,
    "attention_bias": True,
}
YARN = {  # its rope_parameters where config.json gives none
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SWIGLU_ALPHA = 1.702  # GptOssExperts' sigmoid gain (the hub's configs do not write it)


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    if not (d.get("rope_parameters") or d.get("rope_scaling")):
        d["rope_parameters"] = YARN
    if d.get("layer_types") is None:  # as GptOssConfig: sliding, full, sliding, ...
        d["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(d["num_hidden_layers"])
        ]
    fields = common_fields(d)
    experts, top = moe.routing(d)
    method = (d.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise JaxinferError(f"config.json: gpt-oss quantized by {method!r} is not read (MXFP4 and float ones are)")
    attention_bias = bool(d["attention_bias"])
    return ModelConfig(
        architecture=arch,
        **fields,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        attn_sinks=True,
        activation="swiglu_clamped",
        swiglu_limit=float(d["swiglu_limit"]),
        swiglu_alpha=float(d.get("swiglu_alpha", SWIGLU_ALPHA)),
        feed_forwards=("mixture",) * fields["num_layers"],
        num_experts=experts,
        experts_per_token=top,
        expert_size=fields["intermediate_size"],
        norm_topk=True,  # a softmax over the k largest logits: over all, then the k largest renormalised
        mxfp4_experts=method == "mxfp4",
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Llama's attention (its sinks included), and on each layer the router with its bias and the
    experts' stacks: gate/up fused ([E, D, 2F] interleaved → "we_gate_up" [E, 2F, D], all gates then
    all ups) and down ([E, F, D] → "we_down" [E, D, F]), with their biases."""
    table = llama.weight_table(cfg)
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp"
        table[f"{pre}.router.weight"] = Weight(("layers", i, "router"), (E, D), (None, "embed"))
        table[f"{pre}.router.bias"] = Weight(("layers", i, "router_bias"), (E,), (None,))
        for name, leaf, (out, inputs), pairs in (
            ("gate_up_proj", "gate_up", (2 * F, D), "pairs"),
            ("down_proj", "down", (D, F), ""),
        ):
            matrix, bias, experts = ("layers", i, f"we_{leaf}"), ("layers", i, f"be_{leaf}"), ("experts", None, None)
            if cfg.mxfp4_experts:  # [E, out, in] as codes and exponents
                for part, shape in (("blocks", (E, out, inputs // 32, 16)), ("scales", (E, out, inputs // 32))):
                    stored = f"mxfp4 {part} {pairs}".strip()
                    table[f"{pre}.experts.{name}_{part}"] = Weight(matrix, shape, experts, None, stored)
            else:  # transformers' [E, in, out]
                stored = f"in_out {pairs}".strip()
                table[f"{pre}.experts.{name}"] = Weight(matrix, (E, inputs, out), experts, None, stored)
            table[f"{pre}.experts.{name}_bias"] = Weight(bias, (E, out), experts[:2], None, pairs)
    return table
