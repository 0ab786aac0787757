"""GGUF files, with llama.cpp itself as the oracle: the files in tests/data/gguf/ were written by its
converter and quantizer from tiny models, and its tokens, logits and greedy text on them recorded
(`scripts/make_gguf_fixtures.py`). Every tensor type is also checked value for value against the
`gguf` package's dequantization (llama.cpp's reference, ported)."""

import json
import shutil
import struct
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here
from reference import our_prompt_logits

from jaxinfer import forms, gguf_config, gguf_model, weights
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "gguf"
FILES = sorted(p.name for p in DATA.glob("*.gguf"))
GENERATING = [name for name in FILES if not name.startswith("qwen3embed")]  # its vectors: test_embeddings
# How far llama.cpp's logits sit from the file's exact model, as a share of max|logit|: it rounds
# activations to the weights' 16-bit type, or quantizes them to 8 bits for quantized weights (we keep
# them float32, but in our own W8A8 q8_0/q4_0 kernel, which rounds differently); these random models
# amplify such rounding (an F16 file: 5e-4 per product, 3e-3 at the logits). The values themselves
# are checked exactly (test_every_tensor_is_the_files_own_values); `scripts/gguf_quality.py` judges
# the quantized files on the trained bundled model, where they are not chaotic.
TOLERANCE = {"F32": 1e-5, "F16": 5e-3, "BF16": 3e-2}
QUANTIZED_TOLERANCE = 6e-2
# llama.cpp's CPU GELU (Gemma's MLP) reads a table of float16 values at the input rounded to float16
# (ggml's GGML_GELU_FP16): ~1e-4 of max|logit| on these models where the exact GELU is used
GELU_TOLERANCE = 1e-3
# a Gated DeltaNet's q/k l2 norm: llama.cpp puts the model's rms eps in it (1e-5 in these files),
# transformers 1e-6, which we follow (the released Qwen3.5 models' rms eps is 1e-6: the two agree there)
DELTA_TOLERANCE = 1e-4


def kind_of(name: str) -> str:
    return name.split(".")[-2]


def recorded(name: str) -> dict:
    return dict(np.load(DATA / name.replace(".gguf", ".llama_cpp.npz")))


def test_tokens_are_llama_cpp_s():
    """Each tokenizer kind (SentencePiece, Llama 3's and Qwen2's byte-level BPE) over scripts, emoji,
    code, whitespace runs and special tokens written in the text."""
    fixture = json.loads((DATA / "tokens.json").read_text())
    for kind, answer in fixture["by_tokenizer"].items():
        meta = gguf_model.open_gguf(DATA / answer["file"]).meta
        tokenizer = Tokenizer.from_gguf(meta, answer["file"])
        for line, expected in zip(fixture["lines"], answer["tokens"]):
            assert tokenizer.encode(line) == expected, (kind, line)
            specials = set(tokenizer.special_tokens.values())
            if not any(s and s in line for s in specials):  # decode leaves special tokens out
                assert tokenizer.decode(expected) == line.lstrip(" ") or tokenizer.decode(expected) == line


@pytest.mark.parametrize("name", FILES)
def test_every_tensor_is_the_files_own_values(name):
    """The loaded tree's leaves (q/k rows put back in Hugging Face's order, a DeltaNet's in the
    table's) hold exactly what the gguf package's reference dequantizes from the file; Q8_0/Q4_0
    stay in their blocks (q8_0/q4_0)."""
    model = load_model(DATA / name, layout="out_in")
    file = gguf_model.open_gguf(DATA / name)
    table = weights.weight_table(model.config)
    names = gguf_model.gguf_names(file, model.config, table)
    for hf_name, weight in table.items():
        path, name = weight.path, names[hf_name]
        tensor = gguf_model.tensor_named(file, name[0] if isinstance(name, tuple) else name)  # Gemma 3n's: a slice
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        if isinstance(name, tuple):  # gpt-oss's gate and up, one leaf: gate's outputs, then up's
            up = file.tensors[name[1]]
            up_values = gguf.quants.dequantize(np.asarray(up.data), up.tensor_type)
            values = np.concatenate([values, up_values], axis=-2 if values.ndim == 3 else -1)
        values = values.reshape(weight.leaf.shape)
        if path[-1] in ("wq", "wk") and model.config.architecture in gguf_config.PERMUTED:
            values = gguf_model._unpermute(values, model.config.num_heads if path[-1] == "wq" else 2)
        if weight.order is not None:  # a DeltaNet's rows grouped by key head
            values = values[np.asarray(weight.order)]
        leaf = model.params
        for key in path:
            leaf = leaf[key]
        if weight.expert is not None:  # one expert of the file's merged tensor, and of our stack
            values, leaf = values[weight.expert[0]], leaf.expert(jnp.int32(weight.expert[0]))
        if isinstance(leaf, forms.Experts):  # a whole stack of the file's (gpt-oss's table, Gemma 4's)
            leaf = [leaf.expert(jnp.int32(e)) for e in range(model.config.num_experts)]
            held = gguf_model.method_of(tensor.tensor_type.name) is not None
            assert all(isinstance(one, forms.Quantized) == held for one in leaf)
            ours = np.stack([np.asarray(one.dense(), np.float32) for one in leaf])
        else:
            if isinstance(leaf, forms.Quantized):
                assert leaf.method == tensor.tensor_type.name.lower()
            ours = np.asarray(leaf.dense() if forms.is_form(leaf) else leaf, np.float32)
        if model.config.norm_plus_one and path[-1].endswith("norm") and path[-1] != "gate_norm":
            ours = ours + 1  # Gemma's and Qwen3.5's norms scale by 1 + weight; llama.cpp's converter stored the sum
        if path[-1] == "a_log":  # the converter stored -exp(A_log): one rounding each way
            np.testing.assert_allclose(-np.exp(ours), values, rtol=1e-6, err_msg=hf_name)
            continue
        np.testing.assert_array_equal(ours, values.astype(np.float32), err_msg=hf_name)


@pytest.mark.parametrize("name", GENERATING)
def test_logits_and_greedy_text_are_llama_cpp_s(name):
    """Over the prompt and llama.cpp's greedy continuation (teacher-forced): logits within the
    activation rounding llama.cpp does (`TOLERANCE`) and the same next token at ≥ 90% of the positions
    (all of them for F32 and F16); F32 files give llama.cpp's greedy text token for token. A
    mixture's quantized file at all positions but one (a near-tie of its router). Where the fixture
    holds transformers' logits on the checkpoint the file was made of (Gemma 4's), within float32
    rounding of those."""
    answer = recorded(name)
    model = load_model(DATA / name)
    prompt = answer["prompt_ids"].tolist()
    assert model.tokenizer.encode(gguf_prompt()) == prompt
    ids = prompt + answer["greedy"].tolist()
    ours, _ = our_prompt_logits(model, ids[:-1], S=128)
    theirs = answer["logits"][: len(ids) - 1]
    kind = kind_of(name)
    tolerance = TOLERANCE.get(kind, QUANTIZED_TOLERANCE)
    if model.config.activation == "gelu_tanh":
        tolerance = max(tolerance, GELU_TOLERANCE)
    if model.config.recurrent:
        tolerance = max(tolerance, DELTA_TOLERANCE)
    if "transformers" in answer:  # where llama.cpp parts from transformers: within float32 rounding of
        # transformers on the checkpoint the file was made of, and no further from llama.cpp than it is
        reference = answer["transformers"][: len(ids) - 1]
        assert np.abs(ours - reference).max() <= 1e-4 * np.abs(reference).max()
        tolerance = max(tolerance, np.abs(reference - theirs).max() / np.abs(theirs).max() + 1e-4)
    error = np.abs(ours - theirs).max(-1) / np.abs(theirs).max()  # at each position
    if model.config.num_experts and kind not in TOLERANCE:
        # a router whose top choices nearly tie can pick another expert under the other side's
        # rounding of the activations: one position may then move further (gpt-oss's MXFP4 file: one
        # of 44 positions 14.7% apart, the others within 1.1%; our own unquantized product, 51% at
        # one of them, flips there too)
        error = np.sort(error)[:-1]
    assert error.max() <= tolerance
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).mean()
    assert agreement == 1 if kind in ("F32", "F16") else agreement >= 0.9
    if kind_of(name) == "F32":
        engine = Engine(model.config, model.params, 128, eos_ids=())
        generation = Generation(model, engine, prompt, Sampling(), max_tokens=len(answer["greedy"]))
        list(generation)
        assert generation.token_ids == answer["greedy"].tolist()


def test_a_quantized_mixture_scores_its_text_as_llama_cpp_does():
    """Qwen3-MoE's Q4_K_M file (Q4_K and Q6_K expert stacks): the perplexity of the prompt and
    llama.cpp's continuation under our logits within 1% of its own."""
    name = "qwen3moe-bpe-256.Q4_K_M.gguf"
    answer = recorded(name)
    ids = answer["prompt_ids"].tolist() + answer["greedy"].tolist()
    ours, _ = our_prompt_logits(load_model(DATA / name), ids[:-1], S=128)

    def perplexity(logits: np.ndarray) -> float:
        logits = logits.astype(np.float64)
        top = logits.max(-1, keepdims=True)
        log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))

    assert perplexity(ours) == pytest.approx(perplexity(answer["logits"][: len(ids) - 1]), rel=0.01)


def gguf_prompt() -> str:
    return json.loads((DATA / "tokens.json").read_text())["prompt"]


@pytest.mark.parametrize(
    "name, arch, overrides",
    [
        ("llama-sp.F32.gguf", "llama", {}),
        ("gemma-sp.F16.gguf", "gemma", {}),
        ("tiny-phi-sp.F32.gguf", "phi3", {}),
        ("mixtral-sp.F32.gguf", "mixtral", {}),
    ],
)
def test_a_file_is_the_checkpoint_it_was_converted_from(tiny, name, arch, overrides):
    """The GGUF file and the safetensors checkpoint llama.cpp's converter made it from (rebuilt: the
    same seeded model) give the same logits and greedy tokens (a prompt inside Phi-3's window,
    which llama.cpp does not run)."""
    checkpoint = load_model(tiny(arch, "sentencepiece", **overrides), dtype="float32")
    model = load_model(DATA / name, dtype="float32")
    ids = checkpoint.tokenizer.encode("The capital of France is Paris.")[:20]
    ours, theirs = our_prompt_logits(model, ids)[0], our_prompt_logits(checkpoint, ids)[0]
    bound = 1e-5 if name.endswith("F32.gguf") else 5e-3  # an F16 file's weights are rounded
    assert np.abs(ours - theirs).max() <= bound * np.abs(theirs).max()
    greedy = []
    for loaded in (model, checkpoint):
        engine = Engine(loaded.config, loaded.params, 64, eos_ids=())
        generation = Generation(loaded, engine, ids, Sampling(), max_tokens=4 if arch == "phi3" else 16)
        list(generation)
        greedy.append(generation.token_ids)
    assert greedy[0] == greedy[1]


def test_metadata_becomes_the_config_it_stands_for():
    scaled = load_model(DATA / "llama3-bpe.F16.gguf").config
    assert scaled.rope_scaling[0] == "freq_factors" and scaled.tie_word_embeddings
    qwen2 = load_model(DATA / "qwen2-bpe.BF16.gguf")
    assert qwen2.config.qkv_bias and qwen2.computed_in == "float32"  # on the CPU, whatever the storage
    assert load_model(DATA / "qwen2-bpe.BF16.gguf", dtype="float32").dtype == "float32"
    assert load_model(DATA / "qwen3-bpe.F16.gguf").config.qk_norm
    assert load_model(DATA / "llama-sp.Q4_0.gguf").quantize == "q4_0"
    # mixtures: Mixtral is a "llama" file with experts; whether the chosen weights are renormalised is
    # llama.cpp's fixed choice per architecture (the file does not say)
    mixtral = load_model(DATA / "mixtral-sp.F32.gguf").config
    assert (mixtral.architecture, mixtral.num_experts, mixtral.experts_per_token, mixtral.norm_topk) == (
        "MixtralForCausalLM",
        5,
        2,
        True,
    )
    qwen2moe = load_model(DATA / "qwen2moe-bpe.F16.gguf").config
    assert (qwen2moe.expert_size, qwen2moe.shared_expert_size, qwen2moe.norm_topk) == (48, 96, False)
    assert qwen2moe.feed_forwards == ("mixture", "mixture")
    assert load_model(DATA / "qwen3moe-bpe.F32.gguf").config.norm_topk


@pytest.mark.parametrize("name", ["qwen2-bpe.BF16.gguf", "llama3-bpe.F16.gguf"])
def test_chat_prompt_is_the_one_transformers_renders_from_the_file(name):
    """transformers reads the same GGUF file's template (`gguf_file=`) and renders the conversation."""
    import transformers

    from jaxinfer.chat_template import ChatTemplate, read_template

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 東京 🙂"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(DATA, gguf_file=name)
    model = load_model(DATA / name)
    ours = ChatTemplate(read_template(model.path, model.tokenizer.config), model.tokenizer.special_tokens)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages, True) == expected


def test_chat_template_and_special_tokens_come_from_the_file():
    from jaxinfer.chat_template import ChatTemplate, read_template

    model = load_model(DATA / "qwen2-bpe.BF16.gguf")
    template = read_template(model.path, model.tokenizer.config)
    assert template and "<|im_start|>" in template
    text = ChatTemplate(template, model.tokenizer.special_tokens).render([{"role": "user", "content": "hi"}], True)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == model.tokenizer.token_id("<|im_start|>")
    assert model.eos_ids == (model.tokenizer.token_id("<|im_end|>"),)


@pytest.mark.slow
def test_run_takes_a_gguf_file_from_a_path_and_from_the_hub_cache(tmp_path):
    """`-m FILE.gguf`, and `-m org/name --gguf-file NAME` from the hub cache offline: llama.cpp's greedy text."""
    answer = recorded("llama-sp.F32.gguf")
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-GGUF"
    (repo / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(DATA / "llama-sp.F32.gguf", repo / "snapshots" / commit / "tiny-f32.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    offline = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    args = (gguf_prompt(), "-n", "24", "--temp", "0", "--json")
    for model in (["-m", DATA / "llama-sp.F32.gguf"], ["-m", "acme/tiny-GGUF", "--gguf-file", "tiny-f32.gguf"]):
        proc = jaxinfer("run", *model, *args, env=offline)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == answer["greedy"].tolist()
    missing = jaxinfer("run", "-m", "acme/tiny-GGUF", "--gguf-file", "q4.gguf", "Hi", env=offline)
    assert_one_line_error(missing, "acme/tiny-GGUF, file q4.gguf", "HF_HUB_OFFLINE")
    assert_one_line_error(jaxinfer_here("run", "--gguf-file", "q4.gguf", "Hi"), "--gguf-file names a file of a hub")


def test_ollama_names_its_blob(tmp_path, monkeypatch):
    """`ollama:NAME[:TAG]`: the model layer of ollama's manifest, a GGUF file under OLLAMA_MODELS."""
    from jaxinfer.errors import JaxinferError
    from jaxinfer.modeldir import load_config

    digest = "sha256:" + "ab" * 32
    (tmp_path / "blobs").mkdir()
    shutil.copy(DATA / "qwen3-bpe.Q8_0.gguf", tmp_path / "blobs" / digest.replace(":", "-"))
    for name, where in (("tiny", "registry.ollama.ai/library/tiny"), ("hf.co/acme/tiny-GGUF", "hf.co/acme/tiny-GGUF")):
        manifest = tmp_path / "manifests" / where / "q8"
        manifest.parent.mkdir(parents=True)
        layers = [
            {"mediaType": "application/vnd.ollama.image.template"},
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest},
        ]
        manifest.write_text(json.dumps({"layers": layers}))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    for name in ("ollama:tiny:q8", "ollama:hf.co/acme/tiny-GGUF:q8"):
        assert load_config(name)[1].qk_norm  # the qwen3 file
    with pytest.raises(JaxinferError, match="ollama pull tiny:latest"):
        load_config("ollama:tiny")


@pytest.mark.parametrize(
    "name", ["llama-sp-256.Q4_K_M.gguf", "llama3-bpe.F16.gguf", "qwen2-bpe.BF16.gguf", "qwen3moe-bpe-256.Q4_K_M.gguf"]
)
def test_convert_keeps_the_files_model(name, tmp_path):
    """The converted form of a GGUF file: every matrix in its method, the tokenizer (special tokens
    matched whole), the chat template and the end tokens, the same logits."""
    from jaxinfer.convert import convert

    converted = load_model(convert(DATA / name, tmp_path / "converted"))
    model = load_model(DATA / name)
    text = "The capital <|im_start|> of France 東京 🙂"
    ids = model.tokenizer.encode(text)
    assert converted.tokenizer.encode(text) == ids
    assert converted.tokenizer.config.get("chat_template") == model.tokenizer.config.get("chat_template")
    assert converted.eos_ids == model.eos_ids and converted.quantize == model.quantize
    assert forms.methods_of(converted.params) == forms.methods_of(model.params)
    np.testing.assert_array_equal(our_prompt_logits(converted, ids)[0], our_prompt_logits(model, ids)[0])


def corrupted(tmp_path: Path, name: str, change) -> Path:
    out = tmp_path / f"bad-{len(list(tmp_path.iterdir()))}-{name}"
    shutil.copy(DATA / name, out)
    data = bytearray(out.read_bytes())
    out.write_bytes(change(data))
    return out


def test_bad_files_are_one_line_each(tmp_path):
    q4_k = next(t for t in gguf.GGUFReader(DATA / "llama-sp-256.Q4_K_M.gguf").tensors if t.tensor_type.name == "Q4_K")
    cases = [
        (corrupted(tmp_path, "llama-sp.Q4_0.gguf", lambda d: d[: len(d) // 2]), "truncated: a tensor's data runs"),
        (corrupted(tmp_path, "llama-sp.Q4_0.gguf", lambda d: b"GGML" + d[4:]), "not a GGUF file"),
        (corrupted(tmp_path, "llama-sp.Q4_0.gguf", lambda d: d[:4] + struct.pack("<I", 99) + d[8:]), "GGUF version 99"),
        (corrupted(tmp_path, "llama-sp.Q4_0.gguf", lambda d: d[:100]), "cannot be read"),
        (corrupted(tmp_path, "llama-sp.Q4_0.gguf", header_replaced(b"llama", b"mamba")), "architecture 'mamba'"),
        (corrupted(tmp_path, "qwen2-bpe.BF16.gguf", header_replaced(b"gpt2", b"bert")), "tokenizer type 'bert'"),
        (retyped(tmp_path, "llama-sp-256.Q4_K_M.gguf", q4_k, gguf.GGMLQuantizationType.IQ4_XS), "IQ4_XS, a type"),
    ]
    for path, words in cases:
        assert_one_line_error(jaxinfer_here("run", "-m", path, "Hi", "-n", "1"), words)


def header_replaced(old: bytes, new: bytes):
    """Every `old` in the file's metadata (not its tensors' data) made `new`, of the same length."""

    def change(data: bytearray) -> bytes:
        header = gguf.GGUFReader(DATA / "llama-sp.Q4_0.gguf").data_offset if old == b"llama" else None
        header = header or gguf.GGUFReader(DATA / "qwen2-bpe.BF16.gguf").data_offset
        return bytes(data[:header]).replace(old, new) + bytes(data[header:])

    return change


def retyped(tmp_path: Path, name: str, tensor, kind) -> Path:
    """The file with one tensor's type field saying `kind` (of the same block, fewer bytes: it still fits)."""
    at = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:4])
    return corrupted(tmp_path, name, lambda d: d[:at] + struct.pack("<I", kind.value) + d[at + 4 :])


@pytest.mark.parametrize(
    "name",
    [
        "llama-sp-256.Q4_K_M.gguf",
        "llama-sp.Q4_0.gguf",
        "gemma2-sp.Q8_0.gguf",
        "qwen3moe-bpe-256.Q4_K_M.gguf",
        "gpt-oss-bpe.MXFP4_MOE.gguf",
    ],
)
def test_the_roofline_counts_the_bytes_a_file_holds(name):
    """A file's mix of methods (Q4_K_M: q4_k and q6_k; MXFP4_MOE: mxfp4 experts, q8_0 the rest) is what
    `info` (from the file, before loading), `bench` and MBU count."""
    import jax

    from jaxinfer.modeldir import METHODS_KEY, load_config
    from jaxinfer.roofline import Storage, weight_bytes

    model = load_model(DATA / name, layout="out_in")
    held = sum(a.nbytes for a in jax.tree.leaves(model.params))
    assert weight_bytes(model.config, Storage.of_params(model.params)) == held
    _, cfg, config_json = load_config(DATA / name)
    assert config_json[METHODS_KEY] == forms.methods_of(model.params)
    assert weight_bytes(cfg, Storage.of("float32", methods=config_json[METHODS_KEY])) == held


def test_a_quantized_file_refuses_quantize_and_a_float_one_takes_it():
    from jaxinfer.errors import JaxinferError

    with pytest.raises(JaxinferError, match="already stored quantized"):
        load_model(DATA / "llama-sp.Q8_0.gguf", quantize="int8")
    model = load_model(DATA / "llama-sp.F32.gguf", quantize="q8_0", layout="out_in")
    assert isinstance(model.params["layers"][0]["wq"], forms.Quantized)
    assert model.params["layers"][0]["wq"].q.dtype == jnp.int8


@pytest.mark.parametrize("name", ["llama-sp-256.Q4_K_M.gguf", "qwen2-bpe.BF16.gguf"])
def test_a_file_in_the_fused_layout_computes_what_its_own_does(name):
    """A GPU's layout stacks q/k/v and gate/up where the file quantizes them alike (Q4_K_M quantizes
    v by Q6_K: q/k/v stay apart, gate/up are stacked); the same logits within float32 rounding."""
    own, fused = load_model(DATA / name), load_model(DATA / name, layout="fused")
    layer = fused.params["layers"][0]
    assert "wgate_up" in layer and ("wqkv" in layer) == ("Q4_K_M" not in name)
    ids = own.tokenizer.encode(gguf_prompt())
    expected, _ = our_prompt_logits(own, ids, S=128)
    got, _ = our_prompt_logits(fused, ids, S=128)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
