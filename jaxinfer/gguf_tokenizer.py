"""A GGUF file's tokenizer (`tokenizer.ggml.*`) rebuilt as llama.cpp runs it, behind our `Tokenizer`.

- "llama" (SentencePiece-style): the pieces, scores and types become a sentencepiece model (BPE, no
  normalization but the whitespace escape, the dummy prefix as `add_space_prefix` says): sentencepiece's
  BPE merges by piece score exactly as llama.cpp's SPM tokenizer (a port of it) does, with byte fallback.
- "gpt2" (byte-level BPE): the vocabulary and merges become a `tokenizers` BPE, split first by the
  regular expressions llama.cpp runs for the file's pre-tokenizer (`tokenizer.ggml.pre`), with merges
  skipped for whole words in the vocabulary where llama.cpp skips them (`ignore_merges`).
- "gemma4" (SentencePiece-style BPE with merges): spaces escaped as "▁", the text split only at
  newlines, merges over its UTF-8 characters, unknown bytes as `<0xXX>` tokens; a run of newlines
  that is a token of its own is taken whole.

Control and user-defined tokens written in the text are matched whole, as llama.cpp does when it
parses special tokens; `tokenizer_config` gives the BOS/EOS flags and the chat template.
"""

from __future__ import annotations

from jaxinfer.errors import JaxinferError

# llama_token_type: what `tokenizer.ggml.token_type` holds
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _named(names: str, regexes: tuple[str, ...], ignore_merges: bool = False) -> dict:
    return {name: (regexes, ignore_merges) for name in names.split()}


# `tokenizer.ggml.pre` → (the regular expressions llama.cpp splits by, in turn; whether whole words in
# the vocabulary skip the merges), as llama.cpp's llama-vocab.cpp sets them
PRE_TOKENIZERS = {
    **_named("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **_named("gpt-2 phi-2 mpt olmo jais exaone4 mellum a.x-4.0", (_GPT2,)),
    **_named("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", (_LLAMA3,), ignore_merges=True),
    **_named("dbrx smaug-bpe", (_LLAMA3,)),
    **_named("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2", (_QWEN2,)),
    **_named("qwen35", (_QWEN35,)),
    **_named("smollm starcoder refact command-r codeshell exaone minerva-7b", (r"\p{N}", _GPT2)),
    **_named("tekken", (_TEKKEN,), ignore_merges=True),
    **_named("gpt-4o llama4 kanana2 talkie", (_GPT4O,)),
}


def _field(meta: dict, key: str, where: str):
    value = meta.get(key)
    if value is None:
        raise JaxinferError(f"{where}: the GGUF file has no {key}")
    return value


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json's keys as transformers reads them, from the file's metadata: the special
    tokens' text, whether BOS/EOS are added (llama.cpp's defaults where the file says nothing: BOS for
    SentencePiece vocabularies and Llama 3's pre-tokenizer), and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    config = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        at = meta.get(f"tokenizer.ggml.{key}_token_id")
        if at is not None and 0 <= at < len(tokens):
            config[f"{name}_token"] = tokens[at]
    model = meta.get("tokenizer.ggml.model")
    bos_pre = ("llama3", "llama-v3", "llama-bpe", "tekken")
    bos_default = model in ("llama", "gemma4") or meta.get("tokenizer.ggml.pre") in bos_pre
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", bos_default))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def specials(meta: dict) -> list[str]:
    """The tokens matched whole wherever the text writes them: control and user-defined ones."""
    types = meta.get("tokenizer.ggml.token_type") or []
    return [t for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind in (CONTROL, USER_DEFINED) and t]


def sentencepiece_model(meta: dict, where: str) -> bytes:
    """A "llama" vocabulary as a serialized sentencepiece model (BPE)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = meta["tokenizer.ggml.tokens"]
    scores = _field(meta, "tokenizer.ggml.scores", where)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    kinds = {
        NORMAL: pb.ModelProto.SentencePiece.NORMAL,
        UNKNOWN: pb.ModelProto.SentencePiece.UNKNOWN,
        CONTROL: pb.ModelProto.SentencePiece.CONTROL,
        USER_DEFINED: pb.ModelProto.SentencePiece.USER_DEFINED,
        UNUSED: pb.ModelProto.SentencePiece.UNUSED,
        BYTE: pb.ModelProto.SentencePiece.BYTE,
    }
    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = BYTE in types
    model.trainer_spec.vocab_size = len(tokens)
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    # sentencepiece wants exactly one unknown piece and each piece once, never empty: a second unknown
    # or a repeated or empty piece becomes a control token under a name of its own (never produced
    # from text, decoded to nothing)
    has_unknown, seen = False, set()
    for i, (token, score, kind) in enumerate(zip(tokens, scores, types)):
        kind = kind if kind in kinds else NORMAL
        if (kind == UNKNOWN and has_unknown) or token in seen or not token:
            kind, token = CONTROL, f"<jaxinfer placeholder {i}>"
        has_unknown |= kind == UNKNOWN
        seen.add(token)
        model.pieces.add(piece=token, score=float(score), type=kinds[kind])
    if not has_unknown:
        raise JaxinferError(f"{where}: the SentencePiece vocabulary has no unknown token")
    model.trainer_spec.unk_id = next(i for i, p in enumerate(model.pieces) if p.type == kinds[UNKNOWN])
    model.trainer_spec.bos_id = model.trainer_spec.eos_id = model.trainer_spec.pad_id = -1
    return model.SerializeToString()


def bpe_tokenizer(meta: dict, where: str):
    """A "gpt2" or "gemma4" vocabulary as a `tokenizers.Tokenizer` (BOS/EOS added by `jaxinfer.tokenizer`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in _field(meta, "tokenizer.ggml.merges", where)]
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    types = meta.get("tokenizer.ggml.token_type") or []
    kinds = dict(zip(tokens, types))
    whole = [t for t in specials(meta) if kinds[t] == USER_DEFINED]  # matched whole, not special
    if meta.get("tokenizer.ggml.model") == "gemma4":
        tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        whole += [t for t in tokens if t and not t.strip("\n") and kinds.get(t) == NORMAL]  # runs of newlines
    else:
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise JaxinferError(
                f"{where}: the tokenizer's pre-tokenizer {pre!r} is not one jaxinfer reads "
                f"(it reads {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        regexes, ignore_merges = PRE_TOKENIZERS[pre]
        tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in specials(meta) if kinds[t] == CONTROL]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in whole])
    return tokenizer


def check_model(meta: dict, where: str) -> str:
    """The file's tokenizer kind, if jaxinfer reads it."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise JaxinferError(f"{where}: the GGUF file has no tokenizer (tokenizer.ggml.model and tokens)")
    if model not in ("llama", "gpt2", "gemma4"):
        raise JaxinferError(
            f"{where}: tokenizer type {model!r} is not one jaxinfer reads (it reads llama, the SentencePiece kind, "
            "gpt2, byte-level BPE, and gemma4)"
        )
    return model
