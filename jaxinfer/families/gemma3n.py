"""Gemma 3n (text): the layers Gemma 4 grew from (q/k norms, values normed without a weight,
attention unscaled, norms scaling by their weight, a sliding pattern with a rope base per type,
K/V shared by the last layers, per-layer embeddings), with what Gemma 4 dropped
(`jaxinfer.layers.altup`): the residual kept as AltUp's parallel streams, LAuReL's low-rank residual
beside attention, and the first layers' MLPs cutting their gate units to a Gaussian top-k."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, common_fields
from jaxinfer.errors import JaxinferError
from jaxinfer.families import gemma, gemma4

ARCHITECTURES = ("Gemma3nForCausalLM",)

# transformers' defaults for keys a config.json leaves out (Gemma3nTextConfig's: E4B's sizes)
DEFAULTS = {
    "vocab_size": 262400,
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "num_kv_shared_layers": 15,
    "altup_num_inputs": 4,
    "altup_active_idx": 0,
    "altup_correct_scale": True,
    "laurel_rank": 64,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    layers = int(d["num_hidden_layers"])
    types = list(
        d.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    )
    sparsity = tuple(float(s) for s in d.get("activation_sparsity_pattern") or (0.0,) * layers)
    widths = d["intermediate_size"]
    widths = tuple(int(w) for w in widths) if isinstance(widths, (list, tuple)) else (int(widths),) * layers
    if len(types) != layers or len(sparsity) != layers or len(widths) != layers:
        raise JaxinferError(
            f"config.json: layer_types, activation_sparsity_pattern and intermediate_size need {layers} entries each"
        )
    if int(d["altup_active_idx"]) != 0:
        raise JaxinferError("config.json: altup_active_idx other than 0 is not supported")  # as transformers adds
    full, local = gemma.rope_per_type(d)
    fields = common_fields({**d, "layer_types": types, "intermediate_size": widths[0]})
    fields.update(rope_theta=full[0], rope_scaling=full[1])
    return ModelConfig(
        architecture=arch,
        **fields,
        **gemma4.layers_of_3n_and_4(d, local),
        kv_sources=gemma4.kv_sources(types, int(d["num_kv_shared_layers"])),
        per_layer_input=int(d["hidden_size_per_layer_input"]),
        per_layer_vocab=int(d["vocab_size_per_layer_input"]),
        intermediate_sizes=widths,
        altup_inputs=int(d["altup_num_inputs"]),
        altup_correct_scale=bool(d["altup_correct_scale"]),
        laurel_rank=int(d["laurel_rank"]),
        activation_sparsity=sparsity if any(sparsity) else (),
    )


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Gemma 4's table (without its layer scalars), AltUp's and LAuReL's leaves."""
    table = gemma4.weight_table(cfg)
    D, A, R = cfg.hidden_size, cfg.altup_inputs, cfg.laurel_rank
    for j in range(1, A):
        for hf_name, name in (("altup_projections", "altup_in"), ("altup_unembed_projections", "altup_out")):
            table[f"model.{hf_name}.{j - 1}.weight"] = Weight((f"{name}_{j}",), (D, D), (None, None))
    for i in range(cfg.num_layers):
        for hf_name, name, shape, axes in (
            ("altup.modality_router.weight", "altup_router", (A, D), (None, None)),
            ("altup.router_norm.weight", "altup_router_norm", (D,), (None,)),
            ("altup.prediction_coefs.weight", "altup_predict", (A * A, A), (None, None)),
            ("altup.correction_coefs.weight", "altup_correct", (A, A), (None, None)),
            ("altup.correct_output_scale", "altup_scale", (D,), (None,)),
            ("laurel.linear_left.weight", "wlaurel_left", (R, D), (None, "embed")),
            ("laurel.linear_right.weight", "wlaurel_right", (D, R), ("embed", None)),
            ("laurel.post_laurel_norm.weight", "laurel_norm", (D,), ("embed",)),
        ):
            table[f"model.layers.{i}.{hf_name}"] = Weight(("layers", i, name), shape, axes)
    return table
