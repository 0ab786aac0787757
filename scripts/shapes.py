"""Random-weight models of real checkpoints' shapes, for benchmarks (no download needed)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.families import config_from_hf
from jaxinfer.forms import Plain, Quantized, check_layout, is_form, lay_out
from jaxinfer.weights import abstract_params, quantized_here

SHAPES = {
    "smollm-135m": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        sliding_windows=(None,) * 30,
    ),
    "tinyllama-1.1b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        sliding_windows=(None,) * 22,
    ),
    # the GPU's (scripts/compare_gpu.py)
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        sliding_windows=(None,) * 16,
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        sliding_windows=(None,) * 32,
    ),
    # Qwen3-30B-A3B scaled to fit here (its 128 experts of 768, 48 layers → 64 of 384, 8 layers: the
    # shape llama.cpp's mixture figures of issue 55 were measured on), and a dense Qwen3 of the same
    # active size: the same attention, an MLP as wide as the 8 experts a token takes.
    "qwen3-moe-0.7b-a0.16b": ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=1e6,
        qk_norm="heads",
        sliding_windows=(None,) * 8,
        feed_forwards=("mixture",) * 8,
        num_experts=64,
        experts_per_token=8,
        expert_size=384,
        norm_topk=True,
    ),
}
SHAPES["qwen3-0.16b"] = replace(
    SHAPES["qwen3-moe-0.7b-a0.16b"],
    architecture="Qwen3ForCausalLM",
    feed_forwards=(),
    num_experts=0,
    experts_per_token=0,
    expert_size=0,
)
# Qwen3.5-0.8B's layers (24: three Gated DeltaNet layers to one gated attention layer, 16 key and
# value heads of 128 in the DeltaNet, 8 query heads of 256 over 2 kv heads, a quarter of each rotated)
# with the 32k vocabulary of the shapes above instead of its 248k (whose embedding would be half the
# weights): 0.5 B parameters.
SHAPES["qwen3.5-0.5b"] = ModelConfig(
    architecture="Qwen3_5ForCausalLM",
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3584,
    num_layers=24,
    num_heads=8,
    num_kv_heads=2,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_theta=1e7,
    tie_word_embeddings=True,
    qk_norm="heads",
    sliding_windows=(None,) * 24,
    norm_plus_one=True,
    rotary_dim=64,
    attn_output_gate=True,
    mixers=("delta", "delta", "delta", "attention") * 6,
    delta_heads=16,
    delta_value_heads=16,
    delta_key_dim=128,
    delta_value_dim=128,
    delta_conv=4,
)
# gpt-oss-20b's layers (2,880 wide, 64 query heads of 64 over 8 kv heads, sinks, 128-token windows
# every other layer, YaRN; experts of 2,880 with biases, MXFP4 in the released files) scaled to fit
# here: 4 layers of its 24, 8 experts of its 32, 4 a token as there, the 32k vocabulary of the
# shapes above: 1.1 B parameters, 0.7 B active a token.
GPT_OSS = dict(
    vocab_size=32000,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=4,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=4,
    sliding_window=128,
    max_position_embeddings=4096,
)
SHAPES["gpt-oss-1.1b-a0.7b"] = config_from_hf({"architectures": ["GptOssForCausalLM"], **GPT_OSS})
# Gemma 4 E4B's layers (2,560 wide, 8 query heads of 256 over 2 kv heads on the sliding layers, of
# 512 on the full ones, MLPs of 10,240, per-layer embeddings of 256, a 512-token window, five sliding
# layers to a full one) scaled to fit here: 12 layers of its 42, the last 6 sharing K/V (its last 18
# of 42), the 32k vocabulary of the shapes above: 1.3 B parameters.
GEMMA4_E4B = dict(
    vocab_size=32000,
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    global_head_dim=512,
    hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=32000,
    num_kv_shared_layers=6,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
    sliding_window=512,
    final_logit_softcapping=30.0,
    max_position_embeddings=4096,
)
SHAPES["gemma4-e4b-1.3b"] = config_from_hf({"architectures": ["Gemma4ForCausalLM"], **GEMMA4_E4B})
OWN_KEYS = {"GptOssForCausalLM": GPT_OSS, "Gemma4ForCausalLM": GEMMA4_E4B}  # config keys of their own
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma4ForCausalLM": "gemma4_text",
}


def hf_config(cfg: ModelConfig, **keys):
    """The transformers config of a shape (`keys`: token ids and the like on top)."""
    import transformers

    d = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **keys,
    )
    if cfg.num_experts:
        d.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.expert_size,
            norm_topk_prob=cfg.norm_topk,
        )
    if cfg.mixers:
        d.update(
            layer_types=["linear_attention" if m == "delta" else "full_attention" for m in cfg.mixers],
            linear_num_key_heads=cfg.delta_heads,
            linear_num_value_heads=cfg.delta_value_heads,
            linear_key_head_dim=cfg.delta_key_dim,
            linear_value_head_dim=cfg.delta_value_dim,
            linear_conv_kernel_dim=cfg.delta_conv,
            partial_rotary_factor=cfg.rotary_dim / cfg.head_dim,
        )
    if cfg.architecture in OWN_KEYS:  # its own keys, transformers' defaults for the rest
        d = {**OWN_KEYS[cfg.architecture], **keys}
    config = transformers.AutoConfig.for_model(MODEL_TYPES[cfg.architecture], **d)
    config.architectures = [cfg.architecture]
    return config


def random_params(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0) -> dict:
    abstract = abstract_params(cfg, dtype)
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def loaded(cfg: ModelConfig, quantize: str | None = None, dtype=jnp.float32, layout: str | None = None) -> dict:
    """Random weights of `cfg` held as `load_model` holds them: quantized where `--quantize` packs,
    then in `layout` (default: the fastest here)."""
    params = random_params(cfg, dtype)
    if quantize:

        def pack(path, leaf):
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
            if isinstance(leaf, Plain) and quantized_here(keys, leaf.w.shape):
                return Quantized.of(leaf.w, quantize)
            return leaf

        params = jax.tree_util.tree_map_with_path(pack, params, is_leaf=is_form)
    return lay_out(params, check_layout(layout), consume=True)


def deepened(cfg: ModelConfig, params: dict, layers: int, scale: float) -> tuple[ModelConfig, dict]:
    """A deeper model made from a trained one (params as the checkpoint lays them out), for
    speculation with that one as its draft: its layers, then copies of them in turn up to `layers`
    whose output projections (wo, wdown) are multiplied by `scale`. At 0 the copies add nothing and
    its tokens are the small model's; above 0 they move its distribution away from the draft's.
    Returned in the fastest layout here."""
    extra = [params["layers"][i % cfg.num_layers] for i in range(cfg.num_layers, layers)]
    extra = [{k: Plain(v.w * scale) if k in ("wo", "wdown") else v for k, v in layer.items()} for layer in extra]
    deep = replace(cfg, num_layers=layers, sliding_windows=(None,) * layers)
    return deep, lay_out({**params, "layers": params["layers"] + extra}, check_layout(None))
