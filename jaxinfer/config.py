"""The model's static shape and behaviour, and the config.json readers every family shares.

`ModelConfig` is frozen and hashable: it is passed to jit as a static argument, so everything in it
must be something that changes the compiled program. Each family (`jaxinfer.families`) translates
its config.json into one with `common_fields` and its own flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxinfer.errors import JaxinferError


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # ("default",) | ("linear", factor) | ("llama3", factor, low, high, original_max_positions)
    # | ("longrope", short_factors, long_factors, original_max_positions, attention_factor)
    # | ("freq_factors", factors): each frequency divided by its factor (a GGUF file's rope_freqs)
    # | ("yarn", factor, original_max_positions, beta_fast, beta_slow, truncate, attention_factor)
    rope_scaling: tuple = ("default",)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: str = ""  # RMSNorm on q and k before RoPE: "heads" over each head (Qwen3), "whole" over all (OLMoE)
    clip_qkv: float = 0.0  # OLMoE: q, k and v clamped to ±clip_qkv after their norms; 0 = off
    sliding_windows: tuple = ()  # per layer: None (full attention) or the window length
    # of the gated MLP: "silu" (SwiGLU), "gelu_tanh" (Gemma's GeGLU) or "swiglu_clamped" (gpt-oss's
    # experts: the gate clamped above and up to ±swiglu_limit, then (up + 1) · gate · σ(swiglu_alpha · gate))
    activation: str = "silu"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    attn_sinks: bool = False  # gpt-oss: a learned logit per query head joins each softmax's denominator ("sinks" [H])
    mxfp4_experts: bool = False  # gpt-oss as the hub ships it: the experts' stacks as MXFP4 blocks and scales
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + weight), in float32, then casts
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the compute dtype
    attn_scale: float = 0.0  # scores times this; 0: head_dim ** -0.5 (Gemma 2/3: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # Gemma 2: scores → cap · tanh(scores / cap) before the mask; 0 = off
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    sandwich_norms: bool = False  # Gemma 2/3: a norm on the attention's and the MLP's outputs too
    rope_local: tuple = ()  # Gemma 3: (theta, scaling) of the sliding layers; (): as the others
    rotary_dim: int = 0  # Phi-4-mini: rope over the first rotary_dim dims of each head; 0: all of them
    nope_layers: tuple = ()  # SmolLM3: the layers whose attention takes no RoPE (its `no_rope_layers` zeros)
    # Ministral 3 (llama 4's attention temperature): queries times 1 + beta · log(1 + ⌊position / length⌋)
    # for (beta, length); (): none
    query_temperature: tuple = ()
    # Granite (µP): embeddings times `embed_multiplier`, each block's output times `residual_multiplier`
    # before it joins the residual, logits divided by `logit_divisor` (its attention_multiplier is `attn_scale`)
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_divisor: float = 1.0
    # Each layer's feed-forward part (`jaxinfer.layers.feed_forward`): "dense" (the gated MLP),
    # "mixture" (a router, `num_experts` experts of `expert_size` of which each token takes
    # `experts_per_token`, and a shared expert of `shared_expert_size` with a sigmoid gate where it is
    # not 0) or "dense and mixture" (Gemma 4's 26B-A4B: the two side by side, summed); (): every layer dense.
    feed_forwards: tuple = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk: bool = True  # the chosen experts' weights renormalised to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    shared_expert_size: int = 0
    # the experts' gate and up matrices as one stack "we_gate_up" [E, 2F, D] (all the gates, then all
    # the ups), as the checkpoint holds them (`jaxinfer.families.moe.FUSED_KEY`), not two
    fused_experts: bool = False
    # Each layer's mixer (`jaxinfer.model.MIXERS`): "attention", or "delta", a Gated DeltaNet
    # (`jaxinfer.layers.delta_net`: Qwen3-Next, Qwen3.5) with `delta_heads` key heads of
    # `delta_key_dim` and `delta_value_heads` value heads of `delta_value_dim`, after a causal
    # convolution of `delta_conv` taps; (): every layer attention.
    mixers: tuple = ()
    delta_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    delta_conv: int = 0
    delta_qkvz: bool = False  # q, k, v, z interleaved per key head in one matrix (Qwen3-Next's in_proj_qkvz)
    delta_tiled: bool = False  # the file lists value heads tiled over the key heads (h uses key head h % Hk)
    attn_output_gate: bool = False  # Qwen3-Next, Qwen3.5: q_proj also gives each head a sigmoid gate on its output
    # Gemma 4: per layer, its attention's head dim and kv heads (its full layers' heads are wider), and
    # the layer whose K/V it attends over: its own, or (its last `num_kv_shared_layers`) an earlier
    # layer's, which it then neither computes nor stores; (): head_dim, num_kv_heads, its own on every layer
    head_dims: tuple = ()
    kv_head_counts: tuple = ()
    kv_sources: tuple = ()
    v_norm: bool = False  # Gemma 4: values RMS-normalised (no weight) before they are stored
    keys_as_values: tuple = ()  # Gemma 4's attention_k_eq_v: the layers whose values are their keys' projection
    layer_scalar: bool = False  # Gemma 4: each layer's output times a scalar the checkpoint holds
    # Gemma 4's per-layer embeddings: a second table of `per_layer_vocab` rows of `per_layer_input`
    # per layer, mixed with a projection of the embeddings, gating a residual in every layer; 0: none
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    intermediate_sizes: tuple = ()  # per layer MLP width (Gemma 4's double-wide shared layers); (): intermediate_size
    # Gemma 3n (`jaxinfer.layers.altup`): the residual as `altup_inputs` streams of which each layer
    # runs on one (`altup_active`) and corrects the others (0: one stream, as every other family);
    # its learned low-rank residual beside attention (LAuReL, of rank `laurel_rank`); per layer the
    # share of the MLP's gate units cut before the activation (a Gaussian top-k; (): none)
    altup_inputs: int = 0
    altup_active: int = 0
    altup_correct_scale: bool = False
    laurel_rank: int = 0
    activation_sparsity: tuple = ()
    # The multimodal checkpoint (`*ForConditionalGeneration`) this is the text model of: its tensors
    # under model.language_model (or the older language_model.model), the vision tower's skipped
    # (`jaxinfer.families.TOWERS`); "": a text model's checkpoint.
    multimodal: str = ""
    # A text encoder's body with no LM head (`Qwen3Model`-style architectures, a sentence-transformers
    # checkpoint: Qwen3-Embedding, e5-mistral): its tensors may be named without `model.`, a head the
    # checkpoint holds is skipped; it embeds (`jaxinfer.embeddings`) and never generates.
    headless: bool = False
    # Set by load_model from the tokenizer: ids at or above it are never sampled (an embedding
    # padded past the tokenizer, as Qwen2.5 and Phi-3 ship); 0 = every row.
    sampled_vocab: int = 0

    @property
    def sampled_ids(self) -> int:
        """How many ids a token is sampled from (and masked, and scored over): `sampled_vocab`, else all."""
        return self.sampled_vocab or self.vocab_size

    def feed_forward(self, i: int) -> str:
        """Layer i's feed-forward part: "dense", "mixture" or "dense and mixture"."""
        return self.feed_forwards[i] if self.feed_forwards else "dense"

    def mixer(self, i: int) -> str:
        """Layer i's mixer: "attention" or "delta"."""
        return self.mixers[i] if self.mixers else "attention"

    def head_dim_of(self, i: int) -> int:
        return self.head_dims[i] if self.head_dims else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        return self.kv_head_counts[i] if self.kv_head_counts else self.num_kv_heads

    def kv_source(self, i: int) -> int:
        """The layer whose K/V layer i attends over: itself, or the earlier layer it shares them with."""
        return self.kv_sources[i] if self.kv_sources else i

    def mlp_size(self, i: int) -> int:
        return self.intermediate_sizes[i] if self.intermediate_sizes else self.intermediate_size

    @property
    def cached_layers(self) -> tuple[int, ...]:
        """The attention layers that keep K/V of their own: those the KV cache holds, in order."""
        return tuple(i for i in self.attention_layers if self.kv_source(i) == i)

    @property
    def recurrent(self) -> bool:
        """Some layer keeps a state that cannot be cut back to an earlier position (a hybrid)."""
        return "delta" in self.mixers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers whose mixer is attention: those the KV cache holds, in order."""
        return tuple(i for i in range(self.num_layers) if self.mixer(i) == "attention")

    @property
    def mixture_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward part holds experts."""
        return tuple(i for i in range(self.num_layers) if self.feed_forward(i) != "dense")

    # Set by load_model: "int8" stores K/V as int8 with a scale per position and head (`kvcache`);
    # None: in the compute dtype.
    kv_dtype: str | None = None

    # Set by load_model: "bfloat16" rounds the inputs of every matrix product to bfloat16, the sums
    # staying float32 (as transformers and llama.cpp run 16-bit weights); "float32": exact products.
    matmul_inputs: str = "float32"


class Weight(NamedTuple):
    """One checkpoint tensor: where it goes in our tree, its shape, and what each of its dimensions
    indexes, by logical name ("vocab", "embed", "heads", "kv_heads", "mlp", "fused", "experts",
    "expert_mlp": an expert's hidden units; None:
    nothing a mesh splits), from which `jaxinfer.sharding` lays it out over devices. `expert` (e, E):
    the tensor is expert e's slice of a leaf of E stacked along a leading "experts" axis (many
    tensors to one leaf: `leaves_of`); None: the tensor is the whole leaf."""

    path: tuple  # ("layers", 3, "wq") or ("embed",)
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    expert: tuple[int, int] | None = None
    # How the tensor lies against its leaf: "" as the leaf holds it; "in_out": its last two axes
    # swapped ([..., in, out]); "pairs": a gated MLP's gate and up outputs interleaved along its
    # outputs' axis (gate, up, gate, ...), which the leaf holds as all the gates, then all the ups;
    # both: "in_out pairs" (gpt-oss's experts). "mxfp4 blocks" / "mxfp4 scales": one of the two
    # tensors of an MXFP4 matrix (the hub's gpt-oss: codes [..., out, in/32, 16] two a byte, E8M0
    # exponents [..., out, in/32]), which together make one leaf (`weights.mxfp4_leaf`); `axes`
    # are then the leaf's.
    stored: str = ""
    # The leaf's rows (the tensor's first axis) by their index in the tensor, where they differ (a
    # DeltaNet's channels grouped by key head: `jaxinfer.layers.delta_net.channel_order`)
    order: tuple[int, ...] | None = None

    @property
    def leaf(self) -> Weight:
        """The leaf this tensor goes into: itself, or the whole stack of experts, in the leaf's layout."""
        shape, axes = self.shape, self.axes
        if "mxfp4 blocks" in self.stored:
            shape = (*shape[:-2], shape[-2] * 32)
        elif "mxfp4 scales" in self.stored:
            shape = (*shape[:-1], shape[-1] * 32)
        if "in_out" in self.stored:
            shape, axes = (*shape[:-2], shape[-1], shape[-2]), (*axes[:-2], axes[-1], axes[-2])
        if self.expert is not None:
            shape, axes = (self.expert[1], *shape), ("experts", *axes)
        return Weight(self.path, shape, axes)

    @property
    def of_experts(self) -> bool:
        """Whether the tensor is (a slice of) a mixture's stack of experts."""
        return self.expert is not None or self.axes[:1] == ("experts",)

    def arranged(self, array: np.ndarray) -> np.ndarray:
        """The tensor's values as its leaf (or its expert's slice of it) holds them (`stored`)."""
        if "in_out" in self.stored:
            array = np.swapaxes(array, -1, -2)
        if "pairs" in self.stored:
            out = -2 if "in_out" in self.stored else -1
            moved = np.moveaxis(array, out, 0)
            array = np.moveaxis(np.concatenate([moved[0::2], moved[1::2]]), 0, out)
        if self.order is not None:
            array = array[np.asarray(self.order)]
        return np.ascontiguousarray(array)


def leaves_of(table: dict[str, Weight]) -> dict[tuple, Weight]:
    """The tree's leaves a weight table fills, by path, each once (an expert stack once, whole)."""
    return {weight.path: weight.leaf for weight in table.values()}


def stored_methods(table: dict[str, Weight]) -> dict[str, str]:
    """The leaves the checkpoint itself holds quantized, by path ("layers.3.we_down"): their method
    (the hub's gpt-oss: its experts' MXFP4), whatever `--quantize` says of the others."""
    return {".".join(map(str, w.path)): "mxfp4" for w in table.values() if "mxfp4" in w.stored}


def _rope(d: dict) -> tuple[float, tuple]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older keys."""
    params = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    for key in ("original_max_position_embeddings", "max_position_embeddings"):  # longrope's, at the top level
        if key in d:
            params.setdefault(key, d[key])
    return rope_settings(params, d.get("rope_theta", 10000.0))


def rope_settings(params: dict, theta: float) -> tuple[float, tuple]:
    """(theta, scaling) as `ModelConfig` holds them, from one `rope_parameters` dict (`theta`: where
    it names none)."""
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, ("default",)
    if kind == "linear":
        return theta, ("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, (
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    if kind == "longrope":  # as transformers' _compute_longrope_parameters
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or params["max_position_embeddings"] / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short, long = (tuple(float(f) for f in params[key]) for key in ("short_factor", "long_factor"))
        return theta, ("longrope", short, long, original, float(attention))
    if kind == "proportional":  # Gemma 4's full layers: the first share of the frequencies rotate, over the whole head
        return theta, (
            "proportional",
            float(params.get("factor", 1.0)),
            float(params.get("partial_rotary_factor", 1.0)),
        )
    if kind == "freq_factors":  # GGUF's rope_freqs tensor, as llama.cpp applies it (`jaxinfer.gguf_config`)
        return theta, ("freq_factors", tuple(float(f) for f in params["factors"]))
    if kind == "yarn":  # as transformers' _compute_yarn_parameters (and its standardize_rope_params)
        original = int(params.get("original_max_position_embeddings") or params["max_position_embeddings"])
        factor = float(params.get("factor") or params["max_position_embeddings"] / original)
        attention = params.get("attention_factor")
        if attention is None:
            mscale, all_dims = params.get("mscale"), params.get("mscale_all_dim")
            attention = (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims)
                if mscale and all_dims
                else _yarn_mscale(factor)
            )
        fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
        return theta, ("yarn", factor, original, fast, slow, bool(params.get("truncate", True)), float(attention))
    raise JaxinferError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope, yarn)"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _sliding_windows(d: dict, num_layers: int) -> tuple:
    window = d.get("sliding_window")
    if d.get("model_type") in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    layer_types = d.get("layer_types")
    if layer_types is None:
        if d.get("model_type") in ("qwen2", "qwen3") and window is not None:
            first = d.get("max_window_layers", num_layers)
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise JaxinferError(f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in layer_types)


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation(name: str, legacy_gelu: str | None = None) -> str:
    """config.json's activation `name` as `ModelConfig.activation`. `legacy_gelu`: what a bare
    "gelu" means to the family (Gemma's first releases wrote it for the tanh approximation)."""
    if name == "gelu" and legacy_gelu:
        name = legacy_gelu
    if name not in ACTIVATIONS:
        raise JaxinferError(f"config.json: activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def common_fields(d: dict) -> dict:
    """The `ModelConfig` fields every family reads the same way, from config.json `d`. A missing or
    malformed key raises KeyError, TypeError or ValueError: `families.config_from_hf` words it."""
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    layers = int(d["num_hidden_layers"])
    theta, scaling = _rope(d)
    return dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(d, layers),
    )


def rotary_dim(d: dict, head_dim: int, default: float = 1.0) -> int:
    """How many dims of each head RoPE rotates, from config.json's `partial_rotary_factor`
    (transformers 5 keeps it in rope_parameters; the hub's configs write it at the top level)."""
    factor = d.get("partial_rotary_factor", default)
    factor = float((d.get("rope_parameters") or {}).get("partial_rotary_factor", factor))
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise JaxinferError(f"config.json: partial_rotary_factor {factor} leaves {rotary} of {head_dim} dims to rotate")
    return rotary


def longrope_switch(cfg: ModelConfig) -> int:
    """longrope's original context, past which a sequence's every key takes the long factors: as
    transformers recomputes its cache when a sequence grows past it, a row that reaches it is
    prefilled again whole (`Slots`). 0 without longrope."""
    return cfg.rope_scaling[3] if cfg.rope_scaling[0] == "longrope" else 0


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False, long: bool = False, head_dim: int = 0) -> np.ndarray:
    """Inverse RoPE frequencies [rotary dims // 2], with the checkpoint's scaling applied (as
    transformers does); `sliding`: for a sliding-window layer, which Gemma 3 rotates with a base of
    its own; `long`: longrope's long factors (else its short ones); `head_dim`: the layer's (Gemma 4's
    differ), else the model's. "proportional" (Gemma 4's full layers): the first share of the
    frequencies over the whole head, the rest 0 (those dims not rotated)."""
    theta, scaling = cfg.rope_local if sliding and cfg.rope_local else (cfg.rope_theta, cfg.rope_scaling)
    dim = cfg.rotary_dim or head_dim or cfg.head_dim
    powers = theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    inv_freq = 1.0 / powers
    kind = scaling[0]
    if kind == "proportional":
        factor, share = scaling[1:]
        angles = int(share * dim // 2)
        return (np.concatenate([inv_freq[:angles], np.zeros(dim // 2 - angles, np.float32)]) / factor).astype(
            np.float32
        )
    if kind == "longrope":
        return 1.0 / (np.asarray(scaling[2] if long else scaling[1], np.float32) * powers)
    if kind == "linear":
        return inv_freq / scaling[1]
    if kind == "freq_factors":
        return (inv_freq / np.asarray(scaling[1], np.float32)).astype(np.float32)
    if kind == "llama3":
        factor, low, high, old_len = scaling[1:]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if kind == "yarn":  # interpolated (divided by the factor) below the band of dims between the
        # correction range's bounds, extrapolated (as they are) above it, a linear ramp between
        factor, original, fast, slow, truncate, _ = scaling[1:]
        bound = lambda rotations: dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        low, high = bound(fast), bound(slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        kept = 1 - np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        return (1.0 / (factor * powers) * (1 - kept) + inv_freq * kept).astype(np.float32)
    return inv_freq
