"""The GGUF test fixtures (tests/data/gguf/), made and answered by llama.cpp itself, recorded once.

    pip install -e ".[compare]"            # llama-cpp-python: its quantizer and its answers
    python scripts/make_gguf_fixtures.py   # rewrites tests/data/gguf/
    python scripts/make_gguf_fixtures.py mixtral-sp   # (re)makes only these models' files

Tiny random-weight models made by transformers (`tests/tiny_models.py`), each with a tokenizer of a
kind GGUF files carry: a SentencePiece BPE (Llama 2 / Mistral), a byte-level BPE split as Llama 3
splits, one split as Qwen2 does, Gemma's BPE with byte fallback (Gemma 4's "gemma4" in the file).
llama.cpp's own `convert_hf_to_gguf.py` (from the llama-cpp-python source distribution, as
`compare_peers.py` uses it) writes the F32/F16/BF16/Q8_0 files, and its
`llama_model_quantize` the rest (Q4_0, Q4_1, Q5_0, Q4_K_M, Q5_K_M, Q6_K, MXFP4_MOE; the k-quants on a model whose
matrices are 256 wide, as they need). The converter knows real tokenizers by a hash of their output;
these tiny ones it cannot know, so it is told the pre-tokenizer each was made with.

Then llama.cpp (llama-cpp-python, float32 KV cache so only the weights' types differ) answers for each
file: its tokens for every line of `CORPUS` (each tokenizer once), its logits over `PROMPT`, and its
greedy continuation. `tests/test_gguf.py` holds jaxinfer to those answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]
from compare_peers import convert, llama_cpp_source  # noqa: E402
from tiny_models import CORPUS, make_model, sentencepiece_tokenizer  # noqa: E402

from jaxinfer.gguf_tokenizer import _LLAMA3, _QWEN2  # noqa: E402

OUT = ROOT / "tests" / "data" / "gguf"
PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n):"
GREEDY = 24
# tokenized by each tokenizer, line by line: scripts, emoji, code, whitespace runs, special tokens
TOKENIZED = [
    "The capital of France is Paris.",
    "  two  spaces, a tab\tand\n\nnew lines\r\n",
    "東京は日本の首都です。 Ünïcödé façade naïve — “quotes” ‘single’ … €100",
    "Emoji 🙂🚀👍🏽 and 👨‍👩‍👧 family; Здравствуйте мир; مرحبا بالعالم; नमस्ते",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "x = [1, 22, 333, 4444, 55555]  # numbers 3.14159 and 1e-5, it's they'll we'd I'M",
    "<s>special</s> and <|im_start|>user\nhi<|im_end|> and <|begin_of_text|><|eot_id|>",
    " leading space and trailing ",
    "",
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_KINDS = {  # name → (split, specials, BOS, EOS, chat template, the converter's pre-tokenizer name)
    "llama3": (
        _LLAMA3,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        LLAMA3_TEMPLATE,
        "llama-bpe",
    ),
    "qwen2": (_QWEN2, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML_TEMPLATE, "qwen2"),
}


def bpe_writer(kind: str):
    """A function writing a byte-level BPE tokenizer.json of `kind` (BPE_KINDS) into a directory."""
    split, specials, bos, eos, template, _ = BPE_KINDS[kind]

    def write(directory: Path) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator([CORPUS + "\n".join(TOKENIZED[:6])], trainer)
        if bos:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
            )
        tok.save(str(directory / "tokenizer.json"))
        config = {"bos_token": bos, "eos_token": eos, "chat_template": template}
        config.update(tokenizer_class="PreTrainedTokenizerFast", pad_token=eos, unk_token=None)
        (directory / "tokenizer_config.json").write_text(json.dumps(config))

    return write


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma_writer(directory: Path) -> None:
    """A tokenizer.json of Gemma's kind (what Gemma 4's converter reads: a BPE with byte fallback over
    text whose spaces are "▁", its merges within "▁"-led words as SentencePiece's are, the 256 byte
    tokens after the special ones) and a chat template of Gemma 4's turns."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trained.train_from_iterator([CORPUS + "\n".join(TOKENIZED[:6])], trainers.BpeTrainer(vocab_size=340))
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<turn|>", "pad_token": "<pad>", "unk_token": "<unk>"}
    config.update(chat_template=GEMMA_TEMPLATE, tokenizer_class="GemmaTokenizer", add_bos_token=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


# Gemma's special ids, and per-layer embeddings of a row a token (llama.cpp reads no other count)
GEMMA_IDS = dict(bos_token_id=2, eos_token_id=6, pad_token_id=0, vocab_size_per_layer_input=None)
# name → (tiny_models architecture, tokenizer, make_model settings, the GGUF types made of it)
MODELS = {
    "llama-sp": ("llama", "sp", {}, ["F32", "Q8_0", "Q4_0"]),
    "llama3-bpe": ("llama3-scaled", "llama3", dict(bos_token_id=0, eos_token_id=4), ["F16"]),
    "qwen2-bpe": ("qwen2", "qwen2", dict(bos_token_id=None, eos_token_id=2), ["BF16"]),
    "qwen3-bpe": ("qwen3", "qwen2", dict(bos_token_id=None, eos_token_id=2), ["F16", "Q8_0"]),
    "gemma-sp": ("gemma", "sp", {}, ["F16"]),
    "gemma2-sp": ("gemma2", "sp", {}, ["Q8_0"]),
    # llama.cpp takes Gemma 3's pattern of one global layer in 6 as given (the converter writes none)
    # half of each head rotated; llama.cpp runs no sliding window. Not named "phi3": llama.cpp keys a change
    # to its special tokens (right-stripping the text after them) on that name, and these tokens are not Phi-3's
    "tiny-phi-sp": ("phi3", "sp", {}, ["F32"]),
    "gemma3-sp": ("gemma3", "sp", dict(num_hidden_layers=6, sliding_window_pattern=6, intermediate_size=64), ["F32"]),
    # matrices 256 wide: the k-quants' super-blocks
    "llama-sp-256": (
        "llama",
        "sp",
        dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_key_value_heads=2, init_std=0.08),
        ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_1", "Q5_0"],
    ),
    # mixtures: Mixtral as llama.cpp writes it (a "llama" file with experts), Qwen's and OLMoE's own;
    # every layer sparse and no clamp of q/k/v, as llama.cpp runs them
    "mixtral-sp": ("mixtral", "sp", {}, ["F32", "Q8_0"]),
    "qwen2moe-bpe": ("qwen2-moe", "qwen2", dict(bos_token_id=None, eos_token_id=2, decoder_sparse_step=1), ["F16"]),
    "qwen3moe-bpe": ("qwen3-moe", "qwen2", dict(bos_token_id=None, eos_token_id=2), ["F32", "Q8_0"]),
    # llama.cpp's OLMoE takes k's norm as wide as q's: as many kv heads as heads, as OLMoE-1B-7B has
    "olmoe-bpe": (
        "olmoe",
        "qwen2",
        dict(bos_token_id=None, eos_token_id=2, clip_qkv=None, num_key_value_heads=4),
        ["F32"],
    ),
    "qwen3moe-bpe-256": (
        "qwen3-moe",
        "qwen2",
        dict(
            bos_token_id=None,
            eos_token_id=2,
            hidden_size=256,
            moe_intermediate_size=256,
            num_hidden_layers=1,
            head_dim=64,
            init_std=0.08,
        ),
        ["Q4_K_M", "MXFP4_MOE"],
    ),
    # hybrids: Qwen3.5 (two value heads a key head: the converter reorders them, `gguf_config`'s
    # "tiled"), its mixture, Qwen3-Next (its interleaved projections split by the converter; every
    # layer a mixture, as llama.cpp takes it); value heads as wide as key heads, as llama.cpp
    # requires (and the released models have)
    "qwen35-bpe": (
        "qwen3.5",
        "qwen2",
        dict(bos_token_id=None, eos_token_id=2, linear_value_head_dim=16),
        ["F32", "Q8_0"],
    ),
    "qwen35moe-bpe": ("qwen3.5-moe", "qwen2", dict(bos_token_id=None, eos_token_id=2), ["F32"]),
    "qwen3next-bpe": (
        "qwen3-next",
        "qwen2",
        dict(bos_token_id=None, eos_token_id=2, linear_value_head_dim=16, decoder_sparse_step=1),
        ["F32"],
    ),
    # one twist each on Llama's layers: SmolLM3's fourth layer without RoPE (llama.cpp's fixed step),
    # Granite's multipliers, Ministral 3's YaRN and attention temperature (from an original context of 16)
    "smollm3-bpe": (
        "smollm3",
        "llama3",
        dict(bos_token_id=0, eos_token_id=4, num_hidden_layers=4, no_rope_layer_interval=4),
        ["F32"],
    ),
    "granite-bpe": ("granite", "llama3", dict(bos_token_id=0, eos_token_id=4), ["F32"]),
    "ministral3-bpe": ("ministral3", "llama3", dict(bos_token_id=0, eos_token_id=4), ["F32", "Q8_0"]),
    # gpt-oss: sinks, windows of 24 the prompt passes, YaRN, its experts split by the converter into
    # gate and up (a float checkpoint's), then MXFP4 by llama.cpp's quantizer
    "gpt-oss-bpe": ("gpt-oss", "qwen2", dict(bos_token_id=None, eos_token_id=2, init_std=0.1), ["F32", "MXFP4_MOE"]),
    # Gemma 4 with Gemma's own tokenizer kind ("gemma4" in the file): its small models' layers (wider
    # full heads, shared K/V, double-wide MLPs, per-layer embeddings), and the 26B-A4B's (a mixture
    # beside each MLP, keys as values)
    "gemma4-gemma": ("gemma4", "gemma", GEMMA_IDS, ["F32"]),
    "gemma4moe-gemma": ("gemma4-moe", "gemma", GEMMA_IDS, ["F32"]),
    # Gemma 3n at the sizes llama.cpp 0.3.36 fixes whatever the file says (per-layer inputs of 256,
    # LAuReL rank 64, the first 10 layers' MLPs sparse at 0.95, K/V shared from layer 20 on: so none
    # shared in 4 layers); its SentencePiece tokenizer
    "gemma3n-sp": (
        "gemma3n",
        "sp",
        dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=256,
            laurel_rank=64,
            activation_sparsity_pattern=[0.95] * 4,
        ),
        ["F32"],
    ),
}
# Those whose answers hold transformers' logits beside llama.cpp's: Gemma 4's, where llama.cpp 0.3.36
# parts from transformers (its GELU's float16 table over more GELUs a layer: 1.7e-2 of max|logit| on
# the dense file; its mixture beside the MLP 4e-2, for a cause not found) and jaxinfer does not
BESIDE = ("gemma4-gemma", "gemma4moe-gemma", "gemma3n-sp")
CONVERTED = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}  # the converter's --outtype
# llama.h's LLAMA_FTYPE_MOSTLY_*; MXFP4_MOE: experts' stacks MXFP4, the other matrices Q8_0
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "MXFP4_MOE": 38}


def quantize(source: Path, out: Path, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed")


def answers(path: Path, checkpoint: Path | None = None) -> dict:
    """llama.cpp's greedy continuation of PROMPT, on a float32 KV cache, and its logits at every
    position of the prompt and the continuation; with the `checkpoint` the file was made of,
    transformers' logits over the same tokens too (where llama.cpp parts from transformers, the
    tests hold jaxinfer to transformers)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0, seed=0)
    ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    llm.eval(ids)
    greedy = []
    for _ in range(GREEDY):
        greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(greedy[-1:])
    logits = np.array(llm.scores[: llm.n_tokens], np.float32)  # row i: the prediction after token i
    answer = {"prompt_ids": np.asarray(ids), "greedy": np.asarray(greedy), "logits": logits}
    if checkpoint is not None:
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with torch.no_grad():
            answer["transformers"] = hf(torch.tensor([ids + greedy])).logits[0].numpy()
    return answer


# An embedding model as llama.cpp's converter reads one: Qwen3-Embedding's kind (a sentence-transformers
# directory: the last token pooled, normalized; EOS appended to every text by the tokenizer). Its file
# says how it pools (`qwen3.pooling_type`), and its answers are each text's vector from llama.cpp and
# from sentence-transformers on the directory it was made of.
EMBEDDING = "qwen3embed-bpe"
EMBEDDED = TOKENIZED[:6] + ["a"]


def embedding_model(directory: Path) -> Path:
    """A tiny Qwen3 saved as sentence-transformers saves Qwen3-Embedding."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, processors

    def tokenizer(path: Path) -> None:
        bpe_writer("qwen2")(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))]
        )
        tok.save(str(path / "tokenizer.json"))
        # no chat template: sentence-transformers 6 would render every text through it (the "message"
        # modality it infers for a tokenizer with one), where Qwen3-Embedding's saved config says text
        config = json.loads((path / "tokenizer_config.json").read_text())
        config = {k: v for k, v in config.items() if k != "chat_template"} | {"padding_side": "left"}
        (path / "tokenizer_config.json").write_text(json.dumps(config))

    body = make_model(directory / "body", "qwen3", tokenizer, bos_token_id=None, eos_token_id=2)
    word = Transformer(str(body), max_seq_length=128)
    model = SentenceTransformer(modules=[word, Pooling(64, pooling_mode="lasttoken"), Normalize()], device="cpu")
    model.save(str(directory / "st"))
    return directory / "st"


def embedding_answers(path: Path, checkpoint: Path) -> dict:
    """Each of EMBEDDED's vectors from llama.cpp (normalized, as llama-server's) and sentence-transformers."""
    import llama_cpp
    from sentence_transformers import SentenceTransformer

    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=128, verbose=False, n_threads=2, seed=0)
    theirs = np.array([llm.embed(text, normalize=True) for text in EMBEDDED], np.float32)
    reference = SentenceTransformer(str(checkpoint), device="cpu").encode(EMBEDDED)
    return {"texts": np.array(EMBEDDED), "llama_cpp": theirs, "sentence_transformers": reference}


def tokens(path: Path) -> list[list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(line.encode(), add_bos=True, special=True) for line in TOKENIZED]


def main(only: list[str]) -> None:
    import tempfile

    tree = llama_cpp_source(Path(tempfile.gettempdir()))
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        if not only or old.name.split(".")[0] in only:
            old.unlink()
    embedding = not only or EMBEDDING in only
    only = [name for name in only if name != EMBEDDING] or (["-"] if only else [])  # the causal ones asked for
    recorded = OUT / "tokens.json"  # each tokenizer's answers, those of the kinds made now replaced
    recorded_tokens = json.loads(recorded.read_text())["by_tokenizer"] if only and recorded.is_file() else {}
    made = set()
    with tempfile.TemporaryDirectory() as work:
        for name, (arch, tokenizer, settings, kinds) in MODELS.items():
            if only and name not in only:
                continue
            writer = {"sp": sentencepiece_tokenizer, "gemma": gemma_writer}.get(tokenizer) or bpe_writer(tokenizer)
            model_dir = make_model(Path(work) / name, arch, writer, **settings)
            pre = BPE_KINDS[tokenizer][5] if tokenizer in BPE_KINDS else "default"
            base = Path(work) / f"{name}.F32.gguf"
            convert(model_dir, base, "f32", pre, tree)
            for kind in kinds:
                out = OUT / f"{name}.{kind}.gguf"
                if kind in CONVERTED:
                    convert(model_dir, out, CONVERTED[kind], pre, tree)
                else:
                    quantize(base, out, kind)
                np.savez(OUT / f"{name}.{kind}.llama_cpp.npz", **answers(out, model_dir if name in BESIDE else None))
                print(f"{out.name}: {out.stat().st_size / 1e3:.0f} kB")
            if tokenizer not in made:
                recorded_tokens[tokenizer] = {"file": f"{name}.{kinds[0]}.gguf", "tokens": tokens(base)}
                made.add(tokenizer)
        if embedding:
            checkpoint = embedding_model(Path(work) / EMBEDDING)
            out = OUT / f"{EMBEDDING}.F32.gguf"
            convert(checkpoint, out, "f32", BPE_KINDS["qwen2"][5], tree)
            np.savez(OUT / f"{EMBEDDING}.F32.llama_cpp.npz", **embedding_answers(out, checkpoint))
            print(f"{out.name}: {out.stat().st_size / 1e3:.0f} kB")
    fixture = {"prompt": PROMPT, "lines": TOKENIZED, "by_tokenizer": recorded_tokens}
    recorded.write_text(json.dumps(fixture, indent=1))


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(MODELS) - {EMBEDDING}
    if unknown:
        sys.exit(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    main(sys.argv[1:])
