"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's blocks with q/k/v fused into one `qkv_proj`
and gate/up into one `gate_up_proj`, kept fused (one table entry per tensor; on the CPU kernel at
Phi-3-mini's shapes, 1 and 5 rows, f32 and bf16, fused and split measured within ±4%), rope over the
first `partial_rotary_factor` of each head (Phi-4-mini: 0.75), and longrope (Phi-3.5, Phi-4-mini, the
128k Phi-3s: `jaxinfer.model.rope_factors`)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, common_fields, rotary_dim
from jaxinfer.errors import JaxinferError
from jaxinfer.families import llama

ARCHITECTURES = ("Phi3ForCausalLM",)

# transformers' Phi3Config defaults, for keys a config.json leaves out.
DEFAULTS = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    llama.check_silu(d, arch)
    fields = common_fields(d)
    rotary = rotary_dim(d, fields["head_dim"])
    scaling = fields["rope_scaling"]
    if scaling[0] == "longrope" and not len(scaling[1]) == len(scaling[2]) == rotary // 2:
        raise JaxinferError(
            f"config.json: longrope needs {rotary // 2} short and long factors, one per rotated pair of dims"
        )
    return ModelConfig(architecture=arch, **fields, rotary_dim=rotary)


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Llama's names, with `self_attn.qkv_proj` → wqkv ([q; k; v] rows) and `mlp.gate_up_proj` →
    wgate_up ([gate; up] rows) in place of the separate projections. A mesh leaves the fused rows
    whole on each device: split evenly, a device's rows would mix q with k or gate with up."""
    table = llama.weight_table(cfg)
    D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            del table[f"{pre}{name}.weight"]
        table[f"{pre}self_attn.qkv_proj.weight"] = Weight(
            ("layers", i, "wqkv"), ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, D), ("fused", "embed")
        )
        table[f"{pre}mlp.gate_up_proj.weight"] = Weight(("layers", i, "wgate_up"), (2 * F, D), ("fused", "embed"))
    return table
