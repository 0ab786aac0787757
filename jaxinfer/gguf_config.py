"""The config.json a GGUF file's metadata stands for (`families.config_from_hf` reads it): which
Hugging Face architecture runs each `general.architecture`, and what the file leaves out read as
llama.cpp reads it (`_gemma`, `_phi3`, `_twists`: its fixed choices per architecture)."""

from __future__ import annotations

import math

import numpy as np

from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_model import FILE_DTYPES, GGUFFile, layer_types, tensor_named

# general.architecture → the Hugging Face architecture whose family runs it (a "llama" file with
# experts is Mixtral's: `hf_architecture`)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3n": "Gemma3nForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "mistral3": "Ministral3ForCausalLM",  # Ministral 3's, and Mistral Small 3.1+'s text model
}
MIXTRAL = "MixtralForCausalLM"  # a "llama" file with experts (`hf_architecture`)
# Those whose q/k rows llama.cpp's converter permuted (its LlamaModel's), put back as transformers holds them
PERMUTED = (MIXTRAL, *(ARCHITECTURES[arch] for arch in ("llama", "smollm3", "granite", "mistral3")))
HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")
# An embedding model's file says how to pool (`{arch}.pooling_type`, llama.cpp's enum): carried in the
# config as this key, read by `modeldir.load_config` (the body headless) and `loading` (its Pooler)
POOLING_KEY = "gguf_pooling"
POOLINGS = {1: "mean", 2: "cls", 3: "last"}
# Whether llama.cpp renormalises the chosen experts' weights (its `build_moe_ffn`'s norm_w, fixed per
# architecture: the file does not say)
NORM_TOPK = {
    "llama": True,
    "qwen2moe": False,
    "qwen3moe": True,
    "olmoe": False,
    "qwen35moe": True,
    "qwen3next": True,
    "gpt-oss": True,
}
# llama.cpp's sliding-window pattern where the file gives none (every n-th layer global), and the
# layer count of the 27B models, whose queries it scales by (hidden / heads)^-1/2, not head_dim's
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def config_json(file: GGUFFile) -> dict:
    """The config.json the file's metadata stands for (`families.config_from_hf` reads it), with the
    dtype of its layers' float matrices."""
    arch, meta = file.architecture, file.meta
    if arch == "clip":  # llama.cpp's multimodal projector file (`--mmproj`), made beside the text model's
        raise JaxinferError(
            f"{file.path}: a multimodal projector (mmproj) file: images are not supported yet; "
            "-m takes the text model's GGUF file"
        )
    if arch not in ARCHITECTURES:
        raise JaxinferError(
            f"{file.path}: architecture {arch!r} is not one jaxinfer runs from a GGUF file "
            f"(it runs {', '.join(ARCHITECTURES)})"
        )

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise JaxinferError(f"{file.path}: the GGUF file has no {arch}.{name}")
        return value

    embed = tensor_named(file, "token_embd.weight")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    d = {
        "architectures": [hf_architecture(file)],
        "model_type": arch,
        "vocab_size": int(embed.shape[1]),  # ne = [in, out]
        "hidden_size": hidden,
        "intermediate_size": first(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": first(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": arch in ("llama", "gpt-oss") and "blk.0.attn_q.bias" in file.tensors,
    }
    if arch == "gpt-oss":  # llama.cpp's: every other layer sliding, from the first (as transformers')
        d["sliding_window"] = int(key("attention.sliding_window"))
    ends = {meta.get(f"tokenizer.ggml.{end}_token_id") for end in ("eos", "eot", "eom")} - {None}
    if ends:  # llama.cpp ends generation at any of them
        d["eos_token_id"] = sorted(int(e) for e in ends)
    pooling = int(meta.get(f"{arch}.pooling_type", 0))
    if pooling == 4:
        raise JaxinferError(
            f"{file.path}: a reranking model (its pooling type is rank): jaxinfer does not run rerankers"
        )
    if pooling:
        if pooling not in POOLINGS:
            raise JaxinferError(f"{file.path}: its pooling type {pooling} is not one jaxinfer runs")
        d[POOLING_KEY] = POOLINGS[pooling]
    if arch == "gemma4":  # its own keys for all it adds (its mixture's too)
        d.update(_gemma4(file, key, d))
    elif arch == "gemma3n":
        d.update(_gemma3n(file, key, d))
    elif int(meta.get(f"{arch}.expert_count", 0)):
        d.update(_experts(file, key, d))
    if arch in HYBRIDS:
        d.update(_hybrid(file, key, d))
    if arch in ("gemma", "gemma2", "gemma3"):
        d.update(_gemma(file, key, d))
    if arch == "phi3":
        d.update(_phi3(file, key, d))
    elif arch not in ("gemma3n", "gemma4"):
        d.update(_rope_scaling(file, key))
    d.update(_twists(file, key, d))
    floats = [FILE_DTYPES[k] for k in layer_types(file) if k in FILE_DTYPES]
    d["torch_dtype"] = max(set(floats), key=floats.count) if floats else "float32"
    return d


def first(value) -> int:
    """A key llama.cpp takes as one number or one a layer (Gemma 4's): the number, or the first layer's."""
    return int(value[0] if isinstance(value, list) else value)


def hf_architecture(file: GGUFFile) -> str:
    """The Hugging Face architecture a file's `general.architecture` stands for."""
    if file.architecture == "llama" and int(file.meta.get("llama.expert_count", 0)):
        return MIXTRAL
    return ARCHITECTURES[file.architecture]


def _experts(file: GGUFFile, key, d: dict) -> dict:
    """A mixture's keys: the experts, those a token takes, their width (Qwen's own key; Mixtral's and
    OLMoE's the feed-forward length), a shared expert's, and the layers without a router (dense)."""
    arch, layers = file.architecture, range(d["num_hidden_layers"])
    experts = {
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "norm_topk_prob": NORM_TOPK[arch],
        "mlp_only_layers": [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors],
    }
    if arch in ("qwen2moe", "qwen3moe", "qwen35moe", "qwen3next"):
        experts["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        experts["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    return experts


def _hybrid(file: GGUFFile, key, d: dict) -> dict:
    """A Gated DeltaNet hybrid's keys, as llama.cpp's converter writes them (its `ssm.*` names): the
    recurrent layers, the DeltaNet's heads (groups: key heads; time-step rank: value heads) and
    convolution, the rotated share of each head. What the converter changed is said for the family
    to read: Qwen3-Next's in_proj_qkvz split in two, Qwen3.5's value heads tiled over the key heads."""
    value_heads = int(key("ssm.time_step_rank"))
    recurrent = file.meta.get(f"{file.architecture}.attention.recurrent_layers")
    interval = int(key("full_attention_interval", 4))
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(d["num_hidden_layers"])]
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_value_head_dim": int(key("ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "partial_rotary_factor": int(key("rope.dimension_count", d["head_dim"])) / d["head_dim"],
        "gguf_split_qkvz": True,
        "gguf_value_heads_tiled": file.architecture != "qwen3next",
    }


def _rope_scaling(file: GGUFFile, key) -> dict:
    """config.json's rope_scaling from the file: Llama 3's as per-frequency factors (`rope_freqs`), or linear."""
    scaling = file.meta.get(f"{file.architecture}.rope.scaling.type", "none")
    if "rope_freqs.weight" in file.tensors:
        factors = np.asarray(tensor_named(file, "rope_freqs.weight").data, np.float32).tolist()
        return {"rope_scaling": {"rope_type": "freq_factors", "factors": factors}}
    if scaling == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}}
    if scaling == "yarn":  # ggml's correction range is always truncated to whole dims
        yarn = {
            "rope_type": "yarn",
            "factor": float(key("rope.scaling.factor")),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": True,
        }
        if log_mul := float(key("rope.scaling.yarn_log_multiplier", 0.0)):  # llama.cpp takes mscale as 1
            yarn.update(mscale=1.0, mscale_all_dim=log_mul)
        return {"rope_scaling": yarn}
    if scaling != "none":
        raise JaxinferError(f"{file.path}: rope scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    return {}


def _twists(file: GGUFFile, key, d: dict) -> dict:
    """The keys of Llama's layout with one twist, as llama.cpp reads them: SmolLM3's layers without
    RoPE (every fourth: llama.cpp's fixed step), Granite's multipliers, Ministral 3's attention
    temperature over the YaRN original context (Mistral Small's text model has neither)."""
    arch = file.architecture
    if arch == "smollm3":
        return {"no_rope_layer_interval": 4}
    if arch == "granite":
        return {
            "embedding_multiplier": float(key("embedding_scale", 1.0)),
            "residual_multiplier": float(key("residual_scale", 1.0)),
            "attention_multiplier": float(key("attention.scale", d["head_dim"] ** -0.5)),
            "logits_scaling": float(key("logit_scale", 1.0)),
        }
    if arch == "mistral3":  # every rope key given: the family's defaults are Ministral 3's YaRN
        rope = {"rope_type": "default", **d.pop("rope_scaling", {}), "rope_theta": d["rope_theta"]}
        if beta := float(key("attention.temperature_scale", 0.0)):  # over YaRN's original context, else the trained
            rope.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
            rope["llama_4_scaling_beta"] = beta
        return {"rope_parameters": rope, "sliding_window": None}
    return {}


def _gemma(file: GGUFFile, key, d: dict) -> dict:
    """Gemma's keys as llama.cpp reads a file: its GELU; Gemma 2/3's sliding layers (the file's
    pattern, else every 2nd / 6th layer global), soft-caps, the 27B models' query scale; Gemma 3's
    sliding layers' rope base (10000 unless the file says)."""
    arch, layers = file.architecture, d["num_hidden_layers"]
    gemma = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return gemma
    window = int(key("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    pattern = file.meta.get(f"{arch}.attention.sliding_window_pattern", SLIDING_PATTERN[arch])
    if isinstance(pattern, list):  # one flag a layer: sliding or not
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    if window <= 0:
        sliding = [False] * layers
    scalar = d["hidden_size"] // d["num_attention_heads"] if layers == GEMMA_27B_LAYERS[arch] else d["head_dim"]
    gemma.update(
        sliding_window=window or None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=float(key("attn_logit_softcapping", 0.0)) or None,
        final_logit_softcapping=float(key("final_logit_softcapping", 0.0)) or None,
    )
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    return gemma


def _gemma4(file: GGUFFile, key, d: dict) -> dict:
    """Gemma 4's keys, as its converter writes them: one sliding flag a layer, per-layer kv heads (an
    array where the full layers' differ) and feed-forward widths (the shared layers' double-wide),
    the sliding layers' head dim and rope base as "_swa" keys beside the full layers', the full
    layers' proportional rope as `rope_freqs` (factors of 1, and 1e30 for the frequencies that do not
    turn), the shared layers, the per-layer embeddings, the mixture beside each MLP, and keys as
    values where a full layer has no attn_v."""
    layers, full_dim = d["num_hidden_layers"], d["head_dim"]  # attention.key_length: the full layers'
    both = _of_3n_and_4(file, key, layers, per_layer_width=0)
    sliding = [kind == "sliding_attention" for kind in both["layer_types"]]
    shared = both["num_kv_shared_layers"]
    kv = key("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    widths = key("feed_forward_length")
    widths = widths if isinstance(widths, list) else [widths] * layers
    double = shared > 0 and widths[-1] == 2 * widths[0]
    if widths != [widths[0] * (2 if double and i >= layers - shared else 1) for i in range(layers)]:
        raise JaxinferError(f"{file.path}: gemma4.feed_forward_length {widths} is not a width Gemma 4 lays out")
    full = [i for i, s in enumerate(sliding) if not s]
    rope_full = {"rope_type": "default", "rope_theta": d["rope_theta"]}
    if "rope_freqs.weight" in file.tensors:
        factors = np.asarray(tensor_named(file, "rope_freqs.weight").data, np.float32).tolist()
        rope_full.update(rope_type="freq_factors", factors=factors)
    gemma4 = {
        **both,
        "head_dim": int(key("attention.key_length_swa")),
        "num_key_value_heads": int(kv[sliding.index(True)] if any(sliding) else kv[0]),
        "intermediate_size": int(widths[0]),
        "use_double_wide_mlp": double,
        "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": int(kv[i])} for i in full},
        "rope_parameters": {
            "full_attention": rope_full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))},
        },
        "attention_k_eq_v": any(f"blk.{i}.attn_v.weight" not in file.tensors for i in full if i < layers - shared),
    }
    if experts := int(file.meta.get("gemma4.expert_count", 0)):
        gemma4.update(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
        )
    return gemma4


def _gemma3n(file: GGUFFile, key, d: dict) -> dict:
    """Gemma 3n's keys, as its converter writes them: one sliding flag a layer, the sliding layers'
    rope base, the shared layers, the per-layer inputs (their table's rows), AltUp's streams, each
    layer's MLP sparsity as the Gaussian's std multiplier (-inf for a dense layer: read back as the
    share of gate units cut), LAuReL's rank from its matrix. (llama.cpp 0.3.36 reads none of the last
    four: it fixes the released models' values.)"""
    layers = d["num_hidden_layers"]
    multipliers = key("activation_sparsity_scale", [float("-inf")] * layers)
    if len(multipliers) != layers:
        raise JaxinferError(
            f"{file.path}: gemma3n's activation_sparsity_scale has {len(multipliers)} entries, not {layers}"
        )
    widths = key("feed_forward_length")
    return {
        **_of_3n_and_4(file, key, layers),
        "intermediate_size": widths if isinstance(widths, list) else [widths] * layers,
        "rope_local_base_freq": float(key("rope.freq_base_swa", 10000.0)),
        "altup_num_inputs": int(key("altup.num_inputs")),
        "altup_active_idx": int(key("altup.active_idx", 0)),
        "laurel_rank": int(tensor_named(file, "blk.0.laurel_l.weight").shape[1]),  # ne = [hidden, rank]
        "activation_sparsity_pattern": [0.5 * (1 + math.erf(float(m) / math.sqrt(2))) for m in multipliers],
    }


def _of_3n_and_4(file: GGUFFile, key, layers: int, per_layer_width: int | None = None) -> dict:
    """What Gemma 3n's and 4's converters both write: one sliding flag a layer, the window, the final
    soft-cap, the shared layers, the per-layer inputs' width (`per_layer_width`: where the file has
    none; None: it must) and their table's rows."""
    sliding = [bool(s) for s in key("attention.sliding_window_pattern")]
    if len(sliding) != layers:
        raise JaxinferError(
            f"{file.path}: {file.architecture}'s sliding_window_pattern has {len(sliding)} flags, not {layers}"
        )
    width = int(key("embedding_length_per_layer_input", per_layer_width))
    both = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(key("attention.sliding_window")),
        "final_logit_softcapping": float(key("final_logit_softcapping", 0.0)) or None,
        "num_kv_shared_layers": int(key("attention.shared_kv_layers", 0)),
        "hidden_size_per_layer_input": width,
    }
    if width:
        both["vocab_size_per_layer_input"] = int(tensor_named(file, "per_layer_token_embd.weight").shape[1])
    return both


def _phi3(file: GGUFFile, key, d: dict) -> dict:
    """Phi-3's keys: the rotated share of each head; longrope's factors (tensors of their own), its
    attention factor and original context. No sliding window: llama.cpp runs Phi-3 without one."""
    phi3 = {"partial_rotary_factor": int(key("rope.dimension_count", d["head_dim"])) / d["head_dim"]}
    if "rope_factors_long.weight" in file.tensors:
        factors = {
            f"{kind}_factor": np.asarray(tensor_named(file, f"rope_factors_{kind}.weight").data, np.float32).tolist()
            for kind in ("long", "short")
        }
        phi3["rope_scaling"] = {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "attention_factor": float(key("rope.scaling.attn_factor", 1.0)),
        }
    return phi3
