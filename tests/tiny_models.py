"""Tiny Hugging Face checkpoints made on the spot by transformers (random, seeded weights), with a
real tokenizer trained on a few paragraphs, so every test compares against code we did not write."""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.tokenizer import Tokenizer

CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Def fibonacci(n): return n if n < 2 "
    "else fibonacci(n - 1) + fibonacci(n - 2). 東京は日本の首都です。 Emoji 🙂🚀 and ünïcödé text. "
) * 20

# Every tiny model's sizes, before its architecture's own keys.
SIZES = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# A hybrid's: three Gated DeltaNet layers and one gated attention layer, two value heads a key head.
HYBRID = dict(
    num_hidden_layers=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)
# Per architecture: the config keys that make it what it is.
ARCHITECTURES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "llama3-scaled": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        head_dim=24,
    ),
    "llama-linear": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        attention_bias=True,
        mlp_bias=True,
    ),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    # "gelu" is what Gemma's first hub releases wrote for the tanh approximation
    # pad_token_id: Gemma's default 0 is our BOS, which transformers' generate would then mask out
    "gemma": dict(
        model_type="gemma", architectures=["GemmaForCausalLM"], head_dim=32, hidden_act="gelu", pad_token_id=None
    ),
    # capping low enough to bite on these weights; a window the tests' sequences pass; a scalar ≠ head_dim
    "gemma2": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        head_dim=32,
        pad_token_id=None,
        sliding_window=24,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
    ),
    # half of each head rotated (Phi-4-mini rotates 3/4); a window the tests' sequences pass
    "phi3": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        partial_rotary_factor=0.5,
        sliding_window=24,
        pad_token_id=None,
    ),
    # Phi-4-mini's kind: 3/4 of each head rotated, longrope with an original context of 48, which the
    # tests' prompts stay under and their decoding passes (max_position_embeddings 256: factor 16/3)
    "phi3-longrope": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        partial_rotary_factor=0.75,
        pad_token_id=None,
        original_max_position_embeddings=48,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        },
    ),
    # mixtures of experts: odd expert counts, the chosen weights renormalised or not, a dense layer
    # beside a sparse one (Qwen2-MoE's decoder_sparse_step) with a shared expert, OLMoE's clamp biting
    "mixtral": dict(
        model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=5, num_experts_per_tok=2
    ),
    "qwen2-moe": dict(
        model_type="qwen2_moe",
        architectures=["Qwen2MoeForCausalLM"],
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        decoder_sparse_step=2,
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    "olmoe": dict(
        model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts=7, num_experts_per_tok=3, clip_qkv=1.5
    ),
    # hybrids: three Gated DeltaNet layers and one gated attention layer (a quarter of each head
    # rotated), two value heads per key head; Qwen3-Next's interleaved projections with a mixture on
    # every second layer, Qwen3.5's separate ones, dense and with a mixture on every layer
    "qwen3-next": dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        **HYBRID,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=2,
    ),
    "qwen3.5": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], **HYBRID),
    "qwen3.5-moe": dict(
        model_type="qwen3_5_moe_text",
        architectures=["Qwen3_5MoeForCausalLM"],
        **{**HYBRID, "linear_num_value_heads": 2, "linear_value_head_dim": 16},
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # gpt-oss: a window the tests' sequences pass, YaRN from an original context of 64, a clamp that
    # bites; its biases and sinks drawn at random (`make_model`)
    "gpt-oss": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        head_dim=32,
        intermediate_size=64,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=24,
        swiglu_limit=2.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # one twist each on Llama's layers: SmolLM3's second layer without RoPE; Granite's µP
    # multipliers, each away from 1; Ministral 3's YaRN and query temperature from an original
    # context of 16, which the tests' prompts pass (2 at position 16, 3 at 48)
    "smollm3": dict(
        model_type="smollm3", architectures=["SmolLM3ForCausalLM"], no_rope_layer_interval=2, pad_token_id=None
    ),
    "granite": dict(
        model_type="granite",
        architectures=["GraniteForCausalLM"],
        embedding_multiplier=6.0,
        residual_multiplier=0.4,
        attention_multiplier=0.05,
        logits_scaling=3.0,
    ),
    "ministral3": dict(
        model_type="ministral3",
        architectures=["Ministral3ForCausalLM"],
        head_dim=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    # Gemma 4: sliding and full layers alternating, the full ones' heads twice as wide, the last two
    # layers (one of each type) sharing earlier layers' K/V with double-wide MLPs, per-layer
    # embeddings, each layer's scalar drawn at random (`make_model`), a window the tests' sequences pass
    "gemma4": dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        num_hidden_layers=6,
        head_dim=32,
        global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=24,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=384,
        final_logit_softcapping=30.0,
        pad_token_id=None,
    ),
    # Gemma 3n: AltUp's 4 streams, LAuReL, the first layers' MLPs sparse, K/V shared by the last two
    "gemma3n": dict(
        model_type="gemma3n_text",
        architectures=["Gemma3nForCausalLM"],
        num_hidden_layers=6,
        head_dim=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        sliding_window=24,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=None,
        laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
        final_logit_softcapping=30.0,
        pad_token_id=None,
    ),
    # the 26B-A4B's layers: a mixture (8 experts, top 2) beside each MLP, the full layers' values
    # their keys' projection with a kv head of their own, no per-layer embeddings
    "gemma4-moe": dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        num_hidden_layers=4,
        head_dim=32,
        global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=24,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=48,
        pad_token_id=None,
    ),
    # one sliding layer (local base 10000) and one global (base 1e6, linear scaling ×8)
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        head_dim=32,
        pad_token_id=None,
        sliding_window=24,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=24,
    ),
}


def bpe_tokenizer(directory: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE tokenizer.json (the Llama 3 / Qwen kind) with BOS added by its post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )


def sentencepiece_model(vocab_size: int = 400, **ids) -> bytes:
    """A sentencepiece BPE model with byte fallback trained on CORPUS (the Llama 2 / Mistral kind: unk
    0, bos 1, eos 2, unless `ids` says otherwise: sentencepiece's trainer's own keywords)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ")),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        **{"bos_id": 1, "eos_id": 2, "unk_id": 0, **ids},
        minloglevel=2,
    )
    return model.getvalue()


def sentencepiece_tokenizer(directory: Path, vocab_size: int = 400) -> None:
    """A sentencepiece tokenizer.model with byte fallback (the Llama 2 / Mistral kind)."""
    (directory / "tokenizer.model").write_bytes(sentencepiece_model(vocab_size))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}
        )
    )


def make_model(
    directory: Path,
    arch: str = "llama",
    tokenizer: str = "bpe",
    dtype: str = "float32",
    init_std: float = 0.2,
    **overrides,
) -> Path:
    """Save a random-weight model of `arch` with a tokenizer ("bpe", else sentencepiece; or a function writing one
    into the directory) into `directory`; returns it. A small
    `init_std` makes a model whose next token depends mostly on the last one: its greedy text soon
    cycles (what speculation's tests need: drafts that are accepted)."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    write = tokenizer if callable(tokenizer) else bpe_tokenizer if tokenizer == "bpe" else sentencepiece_tokenizer
    write(directory)
    settings = dict(
        vocab_size=Tokenizer(directory).vocab_size,  # the tokenizer's size; a padded embedding is test_loading's case
        **SIZES,
        bos_token_id=0 if tokenizer == "bpe" else 1,
        eos_token_id=1 if tokenizer == "bpe" else 2,
    )
    settings.update({k: v for k, v in ARCHITECTURES[arch].items() if k not in ("model_type", "architectures")})
    settings.update(overrides)
    if "vocab_size_per_layer_input" in settings and settings["vocab_size_per_layer_input"] is None:
        settings["vocab_size_per_layer_input"] = settings["vocab_size"]  # Gemma 4's: a row a token, as llama.cpp needs
    config = transformers.AutoConfig.for_model(ARCHITECTURES[arch]["model_type"], **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init gives near-uniform logits; widen them so argmax is decisive
        for name, p in model.named_parameters():
            if p.dim() > 1 and not name.endswith("_bias"):
                p.normal_(0.0, init_std)
            elif ARCHITECTURES[arch]["model_type"] == "gpt_oss" and "norm" not in name:  # its biases and sinks
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                b.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "per_expert_scale", "correct_output_scale")):  # ones or zeros at init
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory
