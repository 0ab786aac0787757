"""Fill-in-the-middle (`jaxinfer.infill`): the prompt is the one the model's documented form spells
(Qwen2.5-Coder's, read by transformers' tokenizer), cut to the room it has; llama-server's /infill
(llama.vscode's), an OpenAI completion's `suffix` and ollama's generate with `suffix` all give
the tokens of that prompt as a plain completion, greedy; streamed as whole."""

import json

import httpx
import pytest
from test_server import WAIT_S, Served
from tiny_models import bpe_tokenizer, make_model

from jaxinfer.api import Parser
from jaxinfer.errors import JaxinferError
from jaxinfer.infill import prompt_ids
from jaxinfer.loading import load_model

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
BEFORE, AFTER = "def fibonacci(n):\n    ", "\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
FILES = [{"filename": "util.py", "text": "The capital of France is Paris."}, {"filename": "b.py", "text": "x = 1"}]


def fim_tokenizer(directory):
    """The tests' BPE tokenizer with Qwen2.5-Coder's fill-in-the-middle and repository tokens."""
    from tokenizers import AddedToken, Tokenizer

    bpe_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("coder"), "qwen2", fim_tokenizer)


def spelled(prefix: str, suffix: str, files=()) -> str:
    """The prompt as Qwen2.5-Coder's documentation spells it (its repository form with files)."""
    head = "<|repo_name|>myproject\n" if files else ""
    head += "".join(f"<|file_sep|>{f['filename']}\n{f['text']}" for f in files)
    head += "<|file_sep|>filename\n" if files else ""
    return f"{head}<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"


def test_the_prompt_is_the_documented_form_cut_to_its_room(coder):
    """Against the documented string read whole by the `tokenizers` library (transformers 5 would
    read it with Qwen2's own pre-tokenizer, whatever the tokenizer.json says)."""
    from tokenizers import Tokenizer

    theirs = Tokenizer.from_file(str(coder / "tokenizer.json"))
    model = load_model(coder)
    for files in ((), FILES):
        expected = theirs.encode(spelled(BEFORE, AFTER, files)).ids  # BOS first: the tokenizer adds it
        assert prompt_ids(model.tokenizer, BEFORE, AFTER, files) == expected
    whole = prompt_ids(model.tokenizer, BEFORE * 4, AFTER * 4, FILES)
    cut = prompt_ids(model.tokenizer, BEFORE * 4, AFTER * 4, FILES, room=60)
    assert len(cut) <= 60 < len(whole)
    fim = [model.tokenizer.token_id(t) for t in FIM[:3]]
    before, after = cut[cut.index(fim[0]) + 1 : cut.index(fim[1])], cut[cut.index(fim[1]) + 1 : -1]
    full = whole[whole.index(fim[0]) + 1 : whole.index(fim[1])], whole[whole.index(fim[1]) + 1 : -1]
    assert full[0][len(full[0]) - len(before) :] == before and full[1][: len(after)] == after  # its end, its start
    assert model.tokenizer.token_id("<|file_sep|>") not in cut  # the other files went first
    plain = load_model(make_model(coder.parent / "plain", "qwen2"))
    with pytest.raises(JaxinferError, match="no fill-in-the-middle tokens"):
        Parser(plain, 256).parse(0, {"prompt": BEFORE, "suffix": AFTER})
    with pytest.raises(JaxinferError, match='"suffix" goes with "prompt"'):
        Parser(model, 256).parse(0, {"messages": [{"role": "user", "content": "hi"}], "suffix": AFTER})


@pytest.fixture(scope="module")
def served(coder):
    server = Served("-m", str(coder), "-b", "2", "-c", "256")
    yield server
    server.stop()
    assert "Traceback" not in "".join(server.stderr)


def post(served, url, body):
    answer = httpx.post(served.url + url, json=body, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_every_endpoint_fills_the_middle_as_a_completion_of_that_prompt(served):
    greedy = {"temperature": 0, "max_tokens": 16}
    expected = post(served, "/v1/completions", {"prompt": spelled(BEFORE, AFTER, FILES)} | greedy)
    text = expected["choices"][0]["text"]
    infilled = post(
        served,
        "/infill",
        {"input_prefix": BEFORE[:5], "prompt": BEFORE[5:], "input_suffix": AFTER, "input_extra": FILES}
        | {"temperature": 0, "n_predict": 16, "cache_prompt": True, "samplers": ["top_k"], "n_indent": 4},
    )
    assert infilled["content"] == text and infilled["tokens_predicted"] == 16 and infilled["stop_type"] == "limit"
    assert infilled["tokens_evaluated"] == expected["usage"]["prompt_tokens"]
    plain = post(served, "/v1/completions", {"prompt": spelled(BEFORE, AFTER)} | greedy)["choices"][0]["text"]
    said = post(served, "/v1/completions", {"prompt": BEFORE, "suffix": AFTER} | greedy)
    assert said["choices"][0]["text"] == plain
    generated = post(
        served,
        "/api/generate",
        {
            "model": "any",
            "prompt": BEFORE,
            "suffix": AFTER,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 16},
        },
    )
    assert generated["response"] == plain
    streamed = httpx.post(
        served.url + "/infill",
        json={
            "input_prefix": BEFORE,
            "input_suffix": AFTER,
            "input_extra": FILES,
            "n_predict": 16,
            "temperature": 0,
            "stream": True,
        },
        timeout=WAIT_S,
    )
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == text and events[-1]["stop"] and not events[0]["stop"]
    completion = post(served, "/completion", {"prompt": BEFORE, "n_predict": 8, "temperature": 0})
    assert (
        completion["content"]
        == post(served, "/v1/completions", {"prompt": BEFORE, "temperature": 0, "max_tokens": 8})["choices"][0]["text"]
    )


def test_infill_refuses_in_one_line(served):
    for body, said in (
        ({"input_prefix": BEFORE, "input_extra": "util.py"}, "input_extra"),
        ({"input_prefix": BEFORE, "colour": 1}, "unknown field 'colour'"),
        ({"input_prefix": 3}, "must be text"),
    ):
        answer = httpx.post(served.url + "/infill", json=body, timeout=WAIT_S)
        assert answer.status_code == 400 and said in answer.json()["error"]["message"], answer.text
