"""Each family's config.json translation, against how transformers reads the same file: the keys a
hub checkpoint leaves out take transformers' defaults, and the older spellings mean what they meant."""

import numpy as np
import pytest
import transformers

from jaxinfer.config import longrope_switch, rope_inv_freq
from jaxinfer.errors import JaxinferError
from jaxinfer.families import SUPPORTED_ARCHITECTURES, config_from_hf

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

CONFIGS = {
    # gemma-2b's config.json as the hub has it: "gelu" for the tanh approximation, no head_dim
    # default needed (given), tie left out (transformers ties Gemma by default)
    "gemma, legacy gelu": dict(
        model_type="gemma", architectures=["GemmaForCausalLM"], hidden_act="gelu", head_dim=16, **SHAPE
    ),
    "gemma, hidden_activation": dict(
        model_type="gemma",
        architectures=["GemmaForCausalLM"],
        hidden_act="gelu",
        hidden_activation="gelu_pytorch_tanh",
        **SHAPE,
    ),
    "gemma, defaults": dict(model_type="gemma", architectures=["GemmaForCausalLM"], **SHAPE),
    "llama, defaults": dict(model_type="llama", architectures=["LlamaForCausalLM"], **SHAPE),
    "mistral, defaults": dict(model_type="mistral", architectures=["MistralForCausalLM"], **SHAPE),
    "qwen2, defaults": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **SHAPE),
    "qwen3, defaults": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], **SHAPE),
    "smollm3, defaults": dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], **SHAPE),
    # its layer types made from no_rope_layers: sliding only on the layers without RoPE
    "smollm3, sliding": dict(
        model_type="smollm3",
        architectures=["SmolLM3ForCausalLM"],
        **{**SHAPE, "num_hidden_layers": 8},
        use_sliding_window=True,
        sliding_window=64,
    ),
    "granite, defaults": dict(model_type="granite", architectures=["GraniteForCausalLM"], **SHAPE),
    "ministral3, defaults": dict(model_type="ministral3", architectures=["Ministral3ForCausalLM"], **SHAPE),
    "gemma2, defaults": dict(
        model_type="gemma2", architectures=["Gemma2ForCausalLM"], **{**SHAPE, "num_hidden_layers": 4}
    ),
    # gemma-3-4b's text config as the hub has it: the older rope keys, the pattern, torch_dtype
    "gemma3, older keys": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        **{**SHAPE, "num_hidden_layers": 7},
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=256,
        torch_dtype="bfloat16",
    ),
    "gemma3, defaults": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], **SHAPE),
    "phi3, defaults": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], **SHAPE),
    # Phi-4-mini's config.json writes the factor at the top level
    "phi4-mini, partial rotary": dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.75, **SHAPE
    ),
    "gpt-oss, defaults": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], **SHAPE),
    # gpt-oss-20b's config.json as the hub has it: the older rope keys, its layer types written out
    "gpt-oss, older keys": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        **{**SHAPE, "num_hidden_layers": 4},
        head_dim=16,
        num_local_experts=8,
        experts_per_token=4,
        num_experts_per_tok=4,
        rope_theta=150000,
        rope_scaling={
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        swiglu_limit=7.0,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_reads_as_transformers_reads_it(name):
    d = CONFIGS[name]
    ours = config_from_hf(d)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads)
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[
        getattr(theirs, "hidden_activation", None) or theirs.hidden_act
    ]
    if hasattr(theirs, "swiglu_limit"):  # gpt-oss's experts
        act = "swiglu_clamped"
        assert (ours.swiglu_limit, ours.swiglu_alpha) == (theirs.swiglu_limit, theirs.swiglu_alpha)
        assert (ours.num_experts, ours.experts_per_token) == (theirs.num_local_experts, theirs.num_experts_per_tok)
    assert ours.activation == act
    window = getattr(theirs, "sliding_window", None) if getattr(theirs, "use_sliding_window", True) else None
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    assert ours.sliding_windows == tuple(window if t == "sliding_attention" else None for t in types)
    rope = theirs.rope_parameters
    full, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, rope)
    assert ours.rope_theta == full["rope_theta"] and ours.rope_scaling[0] == full["rope_type"]
    assert (ours.rope_local or (ours.rope_theta,))[0] == local["rope_theta"]
    rotary = int(ours.head_dim * (rope if "full_attention" not in rope else full).get("partial_rotary_factor", 1.0))
    assert (ours.rotary_dim or ours.head_dim) == rotary
    if hasattr(theirs, "query_pre_attn_scalar"):
        assert ours.attn_scale == theirs.query_pre_attn_scalar**-0.5
        assert ours.attn_softcap == (theirs.attn_logit_softcapping or 0.0)
        assert ours.final_softcap == (theirs.final_logit_softcapping or 0.0)


def test_gemma_flags():
    cfg = config_from_hf(CONFIGS["gemma, legacy gelu"])
    assert (cfg.activation, cfg.norm_plus_one, cfg.embed_scale, cfg.tie_word_embeddings) == (
        "gelu_tanh",
        True,
        True,
        True,
    )


def test_gemma3_older_keys_mean_what_the_newer_say():
    old = CONFIGS["gemma3, older keys"]
    cfg = config_from_hf(old)
    assert cfg.sliding_windows == (1024,) * 5 + (None, 1024)  # every 6th layer global
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_local) == (1e6, ("linear", 8.0), (1e4, ("default",)))
    newer = transformers.AutoConfig.for_model(**{k: v for k, v in old.items() if k != "architectures"}).to_dict()
    assert "rope_parameters" in newer and "layer_types" in newer and "rope_local_base_freq" not in newer
    assert config_from_hf({**newer, "architectures": old["architectures"]}) == cfg


@pytest.mark.parametrize("attention_factor", [None, 1.1])
def test_longrope_factors_are_transformers(attention_factor):
    """Phi-3.5-mini's rope as its config.json writes it (the older `type` key, the original context at
    the top level), Phi-4-mini's partial rotation: the frequencies and the attention factor of each
    set, against transformers' own longrope function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 2.0, 5.0, 9.0, 20.0, 40.0],
    }
    if attention_factor:
        scaling["attention_factor"] = attention_factor
    d = dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        **SHAPE,
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=scaling,
    )
    cfg = config_from_hf(d)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    for long in (False, True):
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](theirs, None, seq_len=4097 if long else None)
        # float32 pow: numpy vs torch, to the ulp
        np.testing.assert_allclose(rope_inv_freq(cfg, long=long), inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_scaling[4] == pytest.approx(attention, rel=1e-12)
    assert longrope_switch(cfg) == 4096


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen's long-context recipe: truncated bounds
        {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        {"factor": 8.0, "attention_factor": 1.2, "original_max_position_embeddings": 2048},
    ],
)
def test_yarn_factors_are_transformers(scaling):
    """YaRN as gpt-oss, Qwen's long-context configs and DeepSeek's (mscale) write it: the frequencies
    and the attention factor on cos and sin, against transformers' own yarn function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        **SHAPE,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", **scaling},
    )
    cfg = config_from_hf(d)
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](theirs, None)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=1e-6)
    assert cfg.rope_scaling[-1] == pytest.approx(attention, rel=1e-12)


def test_errors_name_what_is_wrong():
    with pytest.raises(JaxinferError, match="GemmaForCausalLM.*Qwen3ForCausalLM|Qwen3ForCausalLM.*GemmaForCausalLM"):
        config_from_hf({**CONFIGS["llama, defaults"], "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(JaxinferError, match="activation 'gelu'"):
        config_from_hf({**CONFIGS["llama, defaults"], "hidden_act": "gelu"})
    with pytest.raises(JaxinferError, match="'gelu_pytorch_tanh' is not supported for LlamaForCausalLM"):
        config_from_hf({**CONFIGS["llama, defaults"], "hidden_act": "gelu_pytorch_tanh"})
    with pytest.raises(JaxinferError, match="activation 'relu'"):
        config_from_hf({**CONFIGS["gemma, defaults"], "hidden_act": "relu"})
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 5,
        "long_factor": [2.0] * 5,
        "original_max_position_embeddings": 64,
    }
    with pytest.raises(JaxinferError, match="longrope needs 8 short and long factors"):
        config_from_hf({**CONFIGS["phi3, defaults"], "rope_scaling": longrope})
    with pytest.raises(JaxinferError, match="rope scaling type 'dynamic' is not supported"):
        config_from_hf({**CONFIGS["phi3, defaults"], "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(JaxinferError, match="hidden_size"):
        config_from_hf({k: v for k, v in CONFIGS["gemma, defaults"].items() if k != "hidden_size"})
    assert set(SUPPORTED_ARCHITECTURES) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
    }
