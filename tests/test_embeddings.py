"""Embeddings (`jaxinfer.embeddings`) against sentence-transformers on the same tiny random models:
a Qwen3-Embedding-like model (its body saved bare, the last token pooled, normalised, a query
prompt, EOS appended by the tokenizer, truncation at its max_seq_length), and a Llama body pooled
by mean over the text without the prompt, through a Dense module. Then batching (a text's vector
is its own, whatever its batch-mates), the scheduler's round (texts embedded between decode steps),
`jaxinfer embed`, and the server's /v1/embeddings (OpenAI's client), /api/embed (ollama's)."""

import base64
import json
import shutil
import threading
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
from cli_helpers import assert_one_line_error, jaxinfer
from test_server import WAIT_S, Served
from tiny_models import bpe_tokenizer, make_model

from jaxinfer import embeddings
from jaxinfer.embeddings import Asked
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Inbox, Request, Scheduler

TEXTS = [
    "The capital of France is Paris.",
    "hello",
    "Emoji 🙂🚀 and ünïcödé text. " * 12,  # over the Qwen3-like model's 64 tokens: truncated as S-T does
    "Def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2).",
    "a",
]
QUERY = "Instruct: find it\nQuery:"


def padded_tokenizer(directory, eos: bool = False):
    """The tests' BPE tokenizer with a padding token (sentence-transformers pads its batches); `eos`:
    Qwen3-Embedding's kind, EOS appended to every text (the token it pools), padding on the left."""
    from tokenizers import Tokenizer, processors

    bpe_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text()) | {"pad_token": "</s>"}
    if eos:
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        tok.save(str(directory / "tokenizer.json"))
        config["padding_side"] = "left"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name → (directory, sentence-transformers' model of it)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    root = tmp_path_factory.mktemp("embeddings")
    qwen3 = make_model(root / "qwen3", "qwen3", partial(padded_tokenizer, eos=True))
    llama = make_model(root / "llama", "llama", padded_tokenizer)
    word = Transformer(str(qwen3), max_seq_length=64)
    last = SentenceTransformer(
        modules=[word, Pooling(64, pooling_mode="lasttoken"), Normalize()],
        device="cpu",
        prompts={"query": QUERY, "document": ""},
    )
    torch.manual_seed(1)
    mean = SentenceTransformer(
        modules=[
            Transformer(str(llama)),
            Pooling(64, pooling_mode="mean", include_prompt=False),
            Dense(64, 48, activation_function=torch.nn.Tanh()),
            Normalize(),
        ],
        device="cpu",
        prompts={"query": QUERY},
        default_prompt_name="query",
    )
    out = {"last": root / "last", "mean": root / "mean"}
    last.save(str(out["last"]))
    mean.save(str(out["mean"]))
    # as the hub's Qwen3-Embedding holds it: a causal architecture's name over the bare body's tensors
    out["hub"] = root / "hub"
    shutil.copytree(out["last"], out["hub"])
    config = json.loads((out["hub"] / "config.json").read_text())
    (out["hub"] / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}))
    return {name: (path, SentenceTransformer(str(path), device="cpu")) for name, path in out.items()}


def ours(path, texts, prompt_name=None, truncate=True, dimensions=None):
    model = load_model(path)
    ids, skips = embeddings.tokenized(model, Asked(texts, dimensions, truncate, prompt_name), 256)
    vectors = embeddings.embed(model.params, model.config, model.pooler, ids, skips)
    return embeddings.shortened(vectors, dimensions, model.pooler)


@pytest.mark.parametrize("name", ["last", "hub", "mean"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_as_sentence_transformers_embeds(made, name, prompt_name):
    path, reference = made[name]
    expected = reference.encode(TEXTS, prompt_name=prompt_name)
    got = ours(path, TEXTS, prompt_name)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert not np.allclose(got[0], got[1], atol=1e-2)  # the texts' vectors differ: the check can fail


def test_the_model_s_own_files_are_read(made):
    model = load_model(made["mean"][0])
    pooler = model.pooler
    assert (pooler.pooling, pooler.normalize, pooler.include_prompt, pooler.default_prompt) == (
        "mean",
        True,
        False,
        "query",
    )
    assert pooler.dense[0].weight.shape == (48, 64) and pooler.dimensions(64) == 48
    assert load_model(made["last"][0]).pooler.max_length == 64
    assert model.config.headless and "lm_head" not in model.params
    with pytest.raises(JaxinferError, match="embedding model"):
        model.check_generates()
    with pytest.raises(JaxinferError, match="prompt_name 'passage': the model has no prompt"):
        pooler.prompt("passage")


def test_converted_the_model_embeds_the_same(made, tmp_path):
    from jaxinfer.convert import convert

    path = made["mean"][0]
    converted = convert(path, tmp_path / "converted")
    np.testing.assert_array_equal(ours(converted, TEXTS, "query"), ours(path, TEXTS, "query"))


def test_a_text_s_vector_is_its_own_whatever_its_batch_mates(made):
    path = made["last"][0]
    model = load_model(path)
    ids = [model.tokenizer.encode(t * n)[:60] for n, t in enumerate(TEXTS * 4, 1)]
    together = embeddings.embed(model.params, model.config, model.pooler, ids)
    alone = np.stack([embeddings.embed(model.params, model.config, model.pooler, [one])[0] for one in ids[:6]])
    np.testing.assert_allclose(together[:6], alone, atol=1e-6)
    lengths = [len(i) for i in ids]
    passes = embeddings.passes(lengths)
    assert sorted(i for group in passes for i in group) == list(range(len(ids))) and len(passes) > 1
    for group in passes:
        rows, longest = embeddings._rows(len(group)), embeddings._bucket(max(lengths[i] for i in group))
        assert rows * longest <= embeddings.EMBED_TOKENS or len(group) == 1


def test_over_the_limit_is_refused_or_truncated_and_dimensions_shorten(made):
    path, reference = made["last"]
    model = load_model(path)
    with pytest.raises(JaxinferError, match="over the 64 this model embeds"):
        embeddings.tokenized(model, Asked([TEXTS[2]]), 256)
    with pytest.raises(JaxinferError, match="at most 64"):
        embeddings.tokenized(model, Asked(["a"], dimensions=65), 256)
    short = ours(path, TEXTS, dimensions=16)
    full = reference.encode(TEXTS)[:, :16]
    np.testing.assert_allclose(short, full / np.linalg.norm(full, axis=1, keepdims=True), atol=2e-6)


def test_the_scheduler_embeds_between_decode_steps(tiny):
    """A generating model's texts (its last token pooled, normalised: the default) embedded in the
    scheduler's round while a request decodes: the same vectors, the same tokens, as each alone."""
    model = load_model(tiny("llama"))
    ids = [model.tokenizer.encode(t) for t in TEXTS[:3]]
    alone = embeddings.embed(model.params, model.config, model.pooler, ids)
    request = lambda: Request(0, model.tokenizer.encode("The capital"), Sampling(temperature=0.0), 40, 0)  # noqa: E731
    plain = []
    Scheduler(model, 2, 128).run([request()], plain.append)
    inbox, records, vectors = Inbox(), [], []
    scheduler = Scheduler(model, 2, 128, max_steps=4)
    inbox.put(request())
    worker = threading.Thread(target=scheduler.run, args=(inbox, records.append))
    worker.start()
    inbox.put(embeddings.Job(ids, [0] * 3, vectors.append))
    inbox.close()
    worker.join(WAIT_S)
    assert records[0]["text"] == plain[0]["text"] and records[0]["generated_tokens"] == 40
    np.testing.assert_array_equal(vectors[0], alone)
    np.testing.assert_allclose(np.linalg.norm(alone, axis=1), 1, atol=1e-6)


def test_jaxinfer_embed_writes_a_line_a_text(made):
    path, reference = made["last"]
    lines = "\n".join(TEXTS[:2] + ["", TEXTS[2]]) + "\n"
    done = jaxinfer("embed", "-m", path, "--prompt-name", "query", stdin=lines)
    assert done.returncode == 1, done.stderr  # the long text is refused without --truncate; the rest written
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2] and "over the 64" in records[2]["error"]
    expected = reference.encode(TEXTS[:2], prompt_name="query")
    np.testing.assert_allclose([r["embedding"] for r in records[:2]], expected, atol=2e-6)
    assert "1 could not be embedded" in done.stderr
    jsonl = json.dumps({"id": "x", "input": "hello"}) + "\nnot json\n"
    done = jaxinfer("embed", "-m", path, "--jsonl", "--truncate", "--dimensions", "8", stdin=jsonl)
    first, second = (json.loads(line) for line in done.stdout.splitlines())
    assert first["id"] == "x" and len(first["embedding"]) == 8 and "not a JSON line" in second["error"]
    assert_one_line_error(jaxinfer("run", "-m", path, "hi"), "embedding model")
    assert_one_line_error(jaxinfer("embed", "-m", path, "--pooling", "sum", "hi"), "--pooling")


@pytest.fixture(scope="module")
def served(made):
    server = Served("-m", str(made["last"][0]), "-b", "2", "-c", "256")
    yield server
    server.stop()
    assert "Traceback" not in "".join(server.stderr)


def test_the_server_embeds_for_openai_s_and_ollama_s_clients(made, served):
    reference = made["last"][1]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", timeout=WAIT_S, max_retries=0)
    said = client.embeddings.create(model="any", input=TEXTS[:2])  # the client asks for base64
    expected = reference.encode(TEXTS[:2])
    np.testing.assert_allclose([d.embedding for d in said.data], expected, atol=2e-6)
    assert said.usage.prompt_tokens == sum(len(reference.tokenize([t])["input_ids"][0]) for t in TEXTS[:2])
    floats = httpx.post(served.url + "/v1/embeddings", json={"input": "hello", "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], expected[1], atol=2e-6)
    coded = httpx.post(served.url + "/v1/embeddings", json={"input": [TEXTS[0]], "encoding_format": "base64"})
    raw = np.frombuffer(base64.b64decode(coded.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(raw, expected[0], atol=2e-6)
    query = httpx.post(served.url + "/v1/embeddings", json={"input": "hello", "prompt_name": "query"}).json()
    np.testing.assert_allclose(query["data"][0]["embedding"], reference.encode("hello", prompt_name="query"), atol=2e-6)

    local = ollama.Client(host=served.url, timeout=WAIT_S)
    got = local.embed(model="any", input=TEXTS)  # ollama truncates unless told not to
    np.testing.assert_allclose(got.embeddings, reference.encode(TEXTS), atol=2e-6)
    assert local.show("any").capabilities == ["embedding"]
    older = httpx.post(served.url + "/api/embeddings", json={"model": "any", "prompt": "hello"}).json()
    np.testing.assert_allclose(older["embedding"], expected[1], atol=2e-6)


def test_the_server_refuses_in_one_line(served):
    long = httpx.post(served.url + "/v1/embeddings", json={"input": TEXTS[2]})
    assert long.status_code == 400 and "over the 64" in long.json()["error"]["message"]
    for body in ({"input": []}, {"input": "a", "dimensions": 0}, {"input": "a", "colour": 1}):
        assert httpx.post(served.url + "/v1/embeddings", json=body).status_code == 400
    refused = httpx.post(served.url + "/api/embed", json={"input": TEXTS[2], "truncate": False})
    assert refused.status_code == 400 and "over the 64" in refused.json()["error"]
    chat = httpx.post(served.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]


GGUF = Path(__file__).parent / "data" / "gguf" / "qwen3embed-bpe.F32.gguf"  # scripts/make_gguf_fixtures.py


def test_a_gguf_embedding_model_embeds_as_llama_cpp_and_sentence_transformers():
    """llama.cpp's converter writes how a sentence-transformers model pools (`qwen3.pooling_type`): the
    file loads headless with that pooling, and its vectors are llama.cpp's and sentence-transformers'
    (on the directory the file was made of, recorded beside it)."""
    answer = np.load(GGUF.with_suffix(".llama_cpp.npz"))
    texts = [str(t) for t in answer["texts"]]
    model = load_model(GGUF)
    assert model.config.headless and model.pooler.pooling == "last" and model.pooler.normalize
    vectors = ours(GGUF, texts)
    np.testing.assert_allclose(vectors, answer["sentence_transformers"], atol=2e-6)
    # llama.cpp's own float32 rounding: 2.5e-4 from sentence-transformers' on this file
    np.testing.assert_allclose(vectors, answer["llama_cpp"], atol=5e-4)
    assert_one_line_error(jaxinfer("run", "-m", GGUF, "hi"), "embedding model")


def test_embedding_requests_past_the_queue_are_refused(made):
    """--max-queue bounds the embedding requests waiting for the scheduler's next round too: one
    more is a 429 at once (the scheduler here never runs, so the waiting ones stay)."""
    from starlette.testclient import TestClient

    from jaxinfer.api import Parser
    from jaxinfer.server import Server

    model = load_model(made["last"][0])
    server = Server(lambda: Scheduler(model, 1, 256), Parser(model, 256), "m", max_queue=2)
    for _ in range(2):
        server.inbox.put(embeddings.Job([[1]], [], lambda result: None))
    refused = TestClient(server.asgi).post("/v1/embeddings", json={"input": "hello"})
    assert refused.status_code == 429 and "2 embedding requests are waiting" in refused.json()["error"]["message"]


def test_a_model_that_embeds_through_its_chat_template_is_refused(made, tmp_path):
    """sentence-transformers 6 saves a 'message' modality for a tokenizer with a chat template and then
    renders every text through it: not done here, so such a model is refused, not answered otherwise."""
    copy = tmp_path / "message"
    shutil.copytree(made["last"][0], copy)
    config = json.loads((copy / "sentence_bert_config.json").read_text())
    formats = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    formats["message"] = formats["text"] | {"format": "flat"}
    (copy / "sentence_bert_config.json").write_text(json.dumps(config | {"modality_config": formats}))
    with pytest.raises(JaxinferError, match="'message' modality"):
        load_model(copy)


def test_bidirectional_and_other_poolings_are_refused_in_one_line(made, tmp_path):
    from jaxinfer.families import config_from_hf

    with pytest.raises(JaxinferError, match="bidirectional attention"):
        config_from_hf({"architectures": ["Gemma3TextModel"], "use_bidirectional_attention": True})
    odd = tmp_path / "odd"
    shutil.copytree(made["last"][0], odd)
    (odd / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(JaxinferError, match="pooling mode 'weightedmean'"):
        load_model(odd)
