"""Gemma 4 (text): Gemma 3's layers (GeGLU, norms around each block, q/k norms, a sliding pattern
with a rope base of its own) with what its sizes add (the small ones' to run fast on a phone):

- its full layers' heads wider (`global_head_dim`, 512 against the sliding layers' 256): attention
  shapes per layer, the KV cache in one group per shape (`jaxinfer.kvcache`);
- KV sharing: the last `num_kv_shared_layers` layers attend over the K/V of the last earlier layer
  of their type, and compute and store none (the cache holds the others only), their MLP twice as
  wide where `use_double_wide_mlp` says;
- per-layer embeddings: a second table of `hidden_size_per_layer_input` per layer, mixed with a
  projection of the embeddings, gating a residual of its own in every layer (`model.per_layer_inputs`);
- values RMS-normalised without a weight, attention unscaled (the q/k norms do it), norms scaling
  by their weight (not 1 + weight), and a scalar on each layer's output;
- the full layers' "proportional" RoPE: a quarter of the frequencies over the whole head;
- the 26B-A4B's mixture beside the MLP (`enable_moe_block`: `jaxinfer.layers.feed_forward`'s "dense
  and mixture"), and the large ones' full layers taking their values from the keys' projection
  (`attention_k_eq_v`), with kv heads of their own (`num_global_key_value_heads`)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig, Weight, activation, common_fields
from jaxinfer.errors import JaxinferError
from jaxinfer.families import gemma, moe

ARCHITECTURES = ("Gemma4ForCausalLM",)

# transformers' defaults for keys a config.json leaves out
DEFAULTS = {
    "vocab_size": 262144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "num_kv_shared_layers": 0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}


def config(d: dict, arch: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    if d.get("use_bidirectional_attention"):
        raise JaxinferError(f"config.json: use_bidirectional_attention is not supported for {arch}")
    layers = int(d["num_hidden_layers"])
    types = list(
        d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    )
    if len(types) != layers:
        raise JaxinferError(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    types[-1] = "full_attention"  # as transformers forces it
    full, local = gemma.rope_per_type(d)
    fields = common_fields({**d, "layer_types": types})
    fields.update(rope_theta=full[0], rope_scaling=full[1])
    head_dims, kv_heads = _per_layer(d, types)
    sources = kv_sources(types, int(d["num_kv_shared_layers"]))
    wide = [2 if d.get("use_double_wide_mlp") and sources[i] != i else 1 for i in range(layers)]
    ple = int(d.get("hidden_size_per_layer_input") or 0)
    full_own = tuple(i for i, t in enumerate(types) if t == "full_attention" and sources[i] == i)
    return ModelConfig(
        architecture=arch,
        **fields,
        **layers_of_3n_and_4(d, local),
        head_dims=head_dims,
        kv_head_counts=kv_heads,
        kv_sources=sources,
        layer_scalar=True,
        per_layer_input=ple,
        per_layer_vocab=int(d["vocab_size_per_layer_input"]) if ple else 0,
        intermediate_sizes=tuple(int(d["intermediate_size"]) * w for w in wide),
        keys_as_values=full_own if d.get("attention_k_eq_v") else (),
        **(_mixture(d, layers) if d.get("enable_moe_block") else {}),
    )


def layers_of_3n_and_4(d: dict, local: tuple) -> dict:
    """What Gemma 3n's layers and Gemma 4's share: Gemma 3's sandwich, q/k norms and sliding layers'
    rope (`local`), values normed without a weight, scores unscaled, norms scaling by their weight."""
    bias = bool(d.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="heads",
        activation=activation(d["hidden_activation"]),
        embed_scale=True,
        attn_scale=1.0,
        final_softcap=float(d.get("final_logit_softcapping") or 0.0),
        sandwich_norms=True,
        rope_local=local,
        v_norm=True,
    )


def _mixture(d: dict, layers: int) -> dict:
    """The mixture beside every layer's MLP: its experts, how many a token takes (its k chosen
    weights renormalised, then each times its expert's scale), each expert's width."""
    sizes = {key: d.get(key) for key in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    if missing := [key for key, size in sizes.items() if not size]:
        raise JaxinferError(f"config.json: enable_moe_block without {', '.join(missing)}")
    experts, top = moe.routing(d, top_key="top_k_experts")
    return dict(
        feed_forwards=("dense and mixture",) * layers,
        num_experts=experts,
        experts_per_token=top,
        expert_size=int(sizes["moe_intermediate_size"]),
        norm_topk=True,
    )


def _per_layer(d: dict, types: list[str]) -> tuple[tuple, tuple]:
    """Each layer's (head dims, kv heads): from transformers 5's `per_layer_config` where config.json
    holds it, else as transformers makes it: the full layers' `global_head_dim`, and with keys as
    values their `num_global_key_value_heads`."""
    head_dim, kv = int(d["head_dim"]), int(d["num_key_value_heads"])
    given = d.get("per_layer_config")
    if given is None:
        full = {"head_dim": int(d["global_head_dim"])}
        if d.get("attention_k_eq_v") and d.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(d["num_global_key_value_heads"])
        given = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    given = {int(layer): part for layer, part in given.items()}  # transformers writes "05" past 9 layers
    own = [given.get(i) or {} for i in range(len(types))]
    return (
        tuple(int(o.get("head_dim", head_dim)) for o in own),
        tuple(int(o.get("num_key_value_heads", kv)) for o in own),
    )


def kv_sources(types: list[str], shared: int) -> tuple:
    """Per layer, the layer whose K/V it attends over: its own, or for the last `shared` layers the
    last layer of their type before them."""
    first = len(types) - shared
    if shared and not set(types[first:]) <= set(types[:first]):
        raise JaxinferError("config.json: a layer type shares K/V that no earlier layer of its type makes")
    last = {t: i for i, t in enumerate(types[:first])}
    return tuple(i if i < first else last[t] for i, t in enumerate(types))


def weight_table(cfg: ModelConfig) -> dict[str, Weight]:
    """Gemma's table (per-layer attention shapes, no k/v on the shared layers), the per-layer
    embeddings' leaves and each layer's scalar (Gemma 3n's table too: it has no scalars)."""
    table = gemma.weight_table(cfg)
    D, L, P = cfg.hidden_size, cfg.num_layers, cfg.per_layer_input
    for i in range(L):
        if cfg.layer_scalar:
            table[f"model.layers.{i}.layer_scalar"] = Weight(("layers", i, "scalar"), (1,), (None,))
        if cfg.feed_forward(i) == "dense and mixture":
            table.update(_mixture_table(cfg, i))
    if not P:
        return table
    table["model.embed_tokens_per_layer.weight"] = Weight(("ple_embed",), (cfg.per_layer_vocab, L * P), (None, None))
    table["model.per_layer_model_projection.weight"] = Weight(("wple_proj",), (L * P, D), (None, "embed"))
    table["model.per_layer_projection_norm.weight"] = Weight(("ple_norm",), (P,), (None,))
    for i in range(L):
        for hf_name, name, shape, axes in (
            ("per_layer_input_gate.weight", "wple_gate", (P, D), (None, "embed")),
            ("per_layer_projection.weight", "wple_out", (D, P), ("embed", None)),
            ("post_per_layer_input_norm.weight", "ple_norm", (D,), ("embed",)),
        ):
            table[f"model.layers.{i}.{hf_name}"] = Weight(("layers", i, name), shape, axes)
    return table


def _mixture_table(cfg: ModelConfig, i: int) -> dict[str, Weight]:
    """Layer i's mixture: the router (its matrix, scale and each expert's scale), the experts' stacks
    as transformers holds them ([E, 2F, D]: all the gates, then all the ups; [E, D, F]) and the three
    norms around the mixture and the MLP beside it."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    pre = f"model.layers.{i}"
    table = {
        f"{pre}.router.proj.weight": Weight(("layers", i, "router"), (E, D), (None, "embed")),
        f"{pre}.router.scale": Weight(("layers", i, "router_scale"), (D,), ("embed",)),
        f"{pre}.router.per_expert_scale": Weight(("layers", i, "expert_scale"), (E,), (None,)),
        f"{pre}.experts.gate_up_proj": Weight(("layers", i, "we_gate_up"), (E, 2 * F, D), moe.STACK),
        f"{pre}.experts.down_proj": Weight(("layers", i, "we_down"), (E, D, F), ("experts", *moe.DOWN)),
    }
    for hf_name, name in (
        ("pre_feedforward_layernorm_2", "mlp_norm_2"),
        ("post_feedforward_layernorm_1", "post_mlp_norm_1"),
        ("post_feedforward_layernorm_2", "post_mlp_norm_2"),
    ):
        table[f"{pre}.{hf_name}.weight"] = Weight(("layers", i, name), (D,), ("embed",))
    return table
