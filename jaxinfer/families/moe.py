"""Mixtures of experts on Llama's attention: Mixtral (every layer a mixture, the chosen experts'
weights renormalised), Qwen2-MoE (q/k/v biases, a shared expert with a sigmoid gate, dense layers
between sparse ones), Qwen3-MoE (q/k RMSNorm per head) and OLMoE (q/k RMSNorm over all heads, an
optional clamp of q/k/v). The mixture itself is `jaxinfer.layers.feed_forward`'s; here, which layers
hold one, and the hub's names for the router and each expert's matrices, every expert's tensor a slice
of one [E, ...] leaf (`config.Weight.expert`), or the two stacks a layer's experts make in
transformers 5's memory, which some checkpoints hold as they are (`FUSED_KEY`)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, common_fields
from jaxinfer.errors import JaxinferError
from jaxinfer.families import llama

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")

# transformers' defaults for keys a config.json leaves out; "experts": the count where it names
# neither `num_experts` (the hub's Qwen and OLMoE files) nor `num_local_experts` (Mixtral's, and what
# transformers 5 writes for Qwen3-MoE).
DEFAULTS = {
    "MixtralForCausalLM": {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "experts": 8,
        "num_experts_per_tok": 2,
    },
    "Qwen2MoeForCausalLM": {
        "max_position_embeddings": 32768,
        "experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
    },
    "Qwen3MoeForCausalLM": {
        "max_position_embeddings": 32768,
        "head_dim": 128,
        "experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
    },
    "OlmoeForCausalLM": {
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    },
}
QWEN = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# A stack's axes: gate's and up's [E, F, D], down's [E, D, F] (a mesh splits each expert's hidden
# units, never the experts: `jaxinfer.sharding.splits`); gate and up fused [E, 2F, D] whole (an even
# split of its rows would give one device the gates, another the ups).
STACK = ("experts", None, None)
GATE_UP, DOWN = ("expert_mlp", None), (None, "expert_mlp")  # one expert's matrices

# Set in a config.json (by `modeldir.load_config`, kept by `convert`) where the checkpoint holds each
# mixture layer's experts as two stacks under transformers 5's own names, `mlp.experts.gate_up_proj`
# [E, 2F, D] (each expert's gates, then its ups) and `mlp.experts.down_proj` [E, D, F]: the hub's
# Qwen3.5-35B-A3B and Qwen3.6-35B-A3B, and any mixture saved from a transformers 5 model's state
# dict. transformers reads either layout into those stacks; so does jaxinfer (`ModelConfig.fused_experts`).
FUSED_KEY = "jaxinfer_fused_experts"
FUSED_TENSOR = ".mlp.experts.gate_up_proj"  # a name only that layout has


def sparse_layers(d: dict, layers: int) -> tuple:
    """Each layer's part, as transformers builds Qwen's (and the Qwen hybrids'): a mixture where
    (i + 1) divides by `decoder_sparse_step` and i is not in `mlp_only_layers`."""
    step, dense = int(d.get("decoder_sparse_step") or 1), set(d.get("mlp_only_layers") or ())
    return tuple("mixture" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(layers))


def routing(d: dict, top_key: str = "num_experts_per_tok") -> tuple[int, int]:
    """(experts, experts a token takes, under `top_key`), checked: `num_experts` or `num_local_experts`."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or d["experts"])
    top = int(d[top_key])
    if not 0 < top <= experts:
        raise JaxinferError(f"config.json: {top} experts per token of {experts} is not a mixture jaxinfer runs")
    return experts, top


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS[arch], **d}
    llama.check_silu(d, arch)
    if arch in QWEN and not d.get("use_sliding_window", False):
        d = {**d, "sliding_window": None, "layer_types": None}
    elif arch in QWEN and d.get("layer_types") is None:  # as Qwen2MoeConfig lays them out
        first, layers = d.get("max_window_layers", d["num_hidden_layers"]), d["num_hidden_layers"]
        sliding = [(i + 1) % 2 and i < first for i in range(layers)]
        d["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    fields = common_fields(d)
    experts, top = routing(d)
    expert_size = int(d["moe_intermediate_size"]) if arch in QWEN else fields["intermediate_size"]
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        **fields,
        qkv_bias=arch == "Qwen2MoeForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2MoeForCausalLM" and attention_bias,
        qk_norm={"Qwen3MoeForCausalLM": "heads", "OlmoeForCausalLM": "whole"}.get(arch, ""),
        clip_qkv=float(d.get("clip_qkv") or 0.0),
        # Mixtral's and OLMoE's layers all mixtures
        feed_forwards=sparse_layers(d, fields["num_layers"]) if arch in QWEN else ("mixture",) * fields["num_layers"],
        num_experts=experts,
        experts_per_token=top,
        expert_size=expert_size,
        norm_topk=arch == "MixtralForCausalLM" or bool(d["norm_topk_prob"]),
        shared_expert_size=int(d["shared_expert_intermediate_size"]) if arch == "Qwen2MoeForCausalLM" else 0,
        fused_experts=bool(d.get(FUSED_KEY, False)),
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Llama's table (its dense MLP on the dense layers only), and on each mixture layer the router,
    every expert's three matrices (Mixtral's w1/w3/w2 are gate/up/down) or the two stacks of
    `FUSED_KEY`, and a shared expert's."""
    table = llama.weight_table(cfg)
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    mixtral = cfg.architecture == "MixtralForCausalLM" and not cfg.fused_experts  # transformers 5 says mlp
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    block = "block_sparse_moe" if mixtral else "mlp"
    for i in range(cfg.num_layers):
        if cfg.feed_forward(i) != "mixture":
            continue
        pre = f"model.layers.{i}.{block}"
        table[f"{pre}.gate.weight"] = Weight(("layers", i, "router"), (E, D), (None, "embed"))
        if cfg.fused_experts:
            table[f"{pre}.experts.gate_up_proj"] = Weight(("layers", i, "we_gate_up"), (E, 2 * F, D), STACK)
            table[f"{pre}.experts.down_proj"] = Weight(("layers", i, "we_down"), (E, D, F), ("experts", *DOWN))
        for e in range(0 if cfg.fused_experts else E):
            for part, shape, axes in (("gate", (F, D), GATE_UP), ("up", (F, D), GATE_UP), ("down", (D, F), DOWN)):
                table[f"{pre}.experts.{e}.{names[part]}.weight"] = Weight(
                    ("layers", i, f"we_{part}"), shape, axes, (e, E)
                )
        if cfg.shared_expert_size:
            S = cfg.shared_expert_size
            for part, shape, axes in (
                ("gate", (S, D), ("mlp", "embed")),
                ("up", (S, D), ("mlp", "embed")),
                ("down", (D, S), ("embed", "mlp")),
            ):
                table[f"{pre}.shared_expert.{part}_proj.weight"] = Weight(("layers", i, f"w{part}"), shape, axes)
            table[f"{pre}.shared_expert_gate.weight"] = Weight(("layers", i, "shared_gate"), (1, D), (None, "embed"))
    return table
