"""Log-probabilities: each token's and its top alternatives', against transformers' logits on the
same weights (through transformers' own repetition-penalty and temperature processors where they
apply); the same whichever way a row is decoded (alone, in a batch, speculating); in the OpenAI
shapes batch writes; each token's bytes as the tokenizer spells them."""

import json

import numpy as np
import pytest
import torch
import transformers
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here
from reference import alone, hf_logits, reference

from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import TOP_LOGPROBS, Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n):"


def _reference_logprobs(hf, ids: list[int], generated: list[int], processors=()) -> np.ndarray:
    """transformers' log-softmax at each generated position [n, V], after `processors` (its own
    LogitsProcessor classes, fed the sequence so far as generate feeds them)."""
    logits = torch.tensor(hf_logits(hf, ids + generated)[len(ids) - 1 : -1])
    rows = []
    for i, row in enumerate(logits):
        seen = torch.tensor([ids + generated[:i]])
        for processor in processors:
            row = processor(seen, row[None])[0]
        rows.append(torch.log_softmax(row, -1).numpy())
    return np.stack(rows)


def _check(entries: list[dict], generated: list[int], expected: np.ndarray, tokenizer, top_n: int) -> None:
    assert len(entries) == len(generated) == len(expected)
    for entry, token, ref in zip(entries, generated, expected):
        assert bytes(entry["bytes"]) == tokenizer.token_bytes(token)
        assert abs(entry["logprob"] - ref[token]) < 1e-4, (entry["logprob"], ref[token])
        top = entry["top_logprobs"]
        assert len(top) == top_n
        ranked = np.sort(ref)[::-1][:top_n]
        np.testing.assert_allclose([a["logprob"] for a in top], ranked, atol=1e-4)
        for a in top:  # each alternative named by its bytes carries its own log-probability
            ids = [i for i in range(len(ref)) if tokenizer.token_bytes(i) == bytes(a["bytes"])]
            assert min(abs(ref[i] - a["logprob"]) for i in ids) < 1e-4


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_greedy_logprobs_are_transformers_log_softmax(tiny, tokenizer):
    path = tiny("llama", tokenizer)
    hf, model = reference(path), load_model(path)
    ids = model.tokenizer.encode(PROMPT)
    gen = Generation(model, Engine(model.config, model.params, 128, ()), ids, Sampling(), 12, logprobs=5)
    list(gen)
    result = gen.result()
    _check(result["logprobs"], gen.token_ids, _reference_logprobs(hf, ids, gen.token_ids), model.tokenizer, 5)
    assert [e["top_logprobs"][0]["bytes"] for e in result["logprobs"]] == [e["bytes"] for e in result["logprobs"]]


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
@pytest.mark.parametrize("arch", ["llama", "phi3-longrope"])
def test_echoed_prompt_logprobs_are_transformers_log_softmax(tiny, arch):
    """`echo`: each prompt token's log-probability given those before it, the model's own (sampling at
    0.7 does not touch it), the first token with none; longrope's factors by the prompt's own length,
    not its padded one (45 tokens pad to 64, past phi3-longrope's original context of 48)."""
    path = tiny(arch)
    hf, model = reference(path), load_model(path)
    engine = Engine(model.config, model.params, 256, ())
    for ids in (model.tokenizer.encode(PROMPT * 2), model.tokenizer.encode(PROMPT * 3)):
        assert 32 < len(ids) <= 48 or len(ids) > 64
        gen = Generation(model, engine, ids, Sampling(temperature=0.7), 2, seed=1, logprobs=3, echo=True)
        list(gen)
        prompt = gen.result()["prompt_logprobs"]
        assert prompt[0] == {**prompt[0], "logprob": None, "top_logprobs": []}
        assert bytes(prompt[0]["bytes"]) == model.tokenizer.token_bytes(ids[0])
        expected = torch.log_softmax(torch.tensor(hf_logits(hf, ids)[:-1]), -1).numpy()
        _check(prompt[1:], ids[1:], expected, model.tokenizer, 3)
    with pytest.raises(JaxinferError, match="needs logprobs"):
        Generation(model, engine, ids, echo=True)
    # a batch's or a server's request: the same entries in its record, with the prompt's text
    records = []
    Scheduler(model, 2, 256).run([Request(0, ids, Sampling(), 2, 1, logprobs=3, echo="the text")], records.append)
    assert records[0]["prompt"] == "the text" and records[0]["prompt_logprobs"] == prompt


def test_sampled_logprobs_are_of_the_distribution_after_penalty_and_temperature(tiny):
    """Temperature 0.7 and repetition penalty 1.3, cut by top-k 40 and top-p 0.9: the log-probabilities
    are those of transformers' penalty then temperature, before the cut; every drawn token lies inside it."""
    path = tiny("llama")
    hf, model = reference(path), load_model(path)
    ids = model.tokenizer.encode(PROMPT)
    sampling = Sampling(temperature=0.7, top_k=40, top_p=0.9, repeat_penalty=1.3)
    gen = Generation(
        model, Engine(model.config, model.params, 128, ()), ids, sampling, 16, seed=5, logprobs=TOP_LOGPROBS
    )
    list(gen)
    processors = (transformers.RepetitionPenaltyLogitsProcessor(1.3), transformers.TemperatureLogitsWarper(0.7))
    expected = _reference_logprobs(hf, ids, gen.token_ids, processors)
    _check(gen.result()["logprobs"], gen.token_ids, expected, model.tokenizer, TOP_LOGPROBS)
    assert all(np.sum(row > row[token]) < 40 for row, token in zip(expected, gen.token_ids))


@pytest.mark.slow  # a model's whole runs: CI's, not the inner loop's
def test_a_row_s_logprobs_do_not_depend_on_its_batch_mates_or_on_speculation(tiny):
    """A mixed batch (greedy and sampled rows, with and without logprobs), and prompt-lookup
    speculation: every row's tokens and log-probabilities as the row's alone; recording changes no token."""
    path = tiny("llama")
    model = load_model(path)
    prompt = model.tokenizer.encode("one two three one two three one two three one two")
    requests = [
        Request(0, prompt, Sampling(), 20, seed=1, logprobs=3),
        Request(1, prompt[:7], Sampling(temperature=0.9, top_p=0.95), 20, seed=2, logprobs=0),
        Request(2, prompt[:5], Sampling(temperature=1.2), 20, seed=3),
        Request(3, prompt, Sampling(), 20, seed=4, speculate=True, logprobs=3),
    ]
    records = {}
    runner = Scheduler(model, 4, 128, Decoding(speculation=Speculation(draft=4)))
    runner.run(requests, lambda r: records.__setitem__(r["id"], r))
    engine = Engine(model.config, model.params, 128, model.eos_ids)
    for request in requests:
        if request.logprobs is None:
            assert records[request.id]["text"] == alone(model, request).text
            assert "logprobs" not in records[request.id]
            continue
        gen = Generation(
            model, engine, request.prompt_ids, request.sampling, 20, request.seed, logprobs=request.logprobs
        )
        list(gen)
        assert records[request.id]["text"] == gen.text
        theirs, ours = gen.result()["logprobs"], records[request.id]["logprobs"]
        assert [e["bytes"] for e in ours] == [e["bytes"] for e in theirs]
        np.testing.assert_allclose([e["logprob"] for e in ours], [e["logprob"] for e in theirs], atol=1e-5)
        assert [[a["bytes"] for a in e["top_logprobs"]] for e in ours] == [
            [a["bytes"] for a in e["top_logprobs"]] for e in theirs
        ]
    assert runner.slots.counters.accepted.sum() > 0  # the speculating row kept drafts


@pytest.mark.parametrize("tokenizer", ["bpe", "sentencepiece"])
def test_token_bytes_spell_the_text(tiny, tokenizer):
    """Byte-level BPE (a tiny tokenizer.json) and sentencepiece with byte fallback (the bundled
    model's tokenizer.model): characters split across tokens come back byte for byte."""
    model = load_model(tiny("llama") if tokenizer == "bpe" else None)
    text = "héllo wörld 東京 🙂 tabs\tand\nnewlines"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    spelled = b"".join(model.tokenizer.token_bytes(i) for i in ids)
    decoded = model.tokenizer.decode(ids)
    assert spelled.decode() in (decoded, " " + decoded)  # sentencepiece's dummy prefix is a space
    assert any(len(model.tokenizer.token_bytes(i)) == 1 and model.tokenizer.token_bytes(i)[0] >= 0x80 for i in ids)
    assert model.tokenizer.token_bytes(model.tokenizer.eos_id) == b"</s>"
    assert model.tokenizer.token_bytes(10**6) == b""


@pytest.mark.slow
def test_cli_logprobs_in_run_and_in_openai_batch_shapes(tmp_path):
    run = jaxinfer("run", "def main(", "-n", "4", "--logprobs", "2", "--json", "--no-stats")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert len(result["logprobs"]) == result["generated_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in result["logprobs"])
    table = jaxinfer("run", "def main(", "-n", "4", "--logprobs", "1", "--no-stats")
    assert "alternatives" in table.stderr and "logprob" not in table.stdout
    echoed = json.loads(jaxinfer("run", "def main(", "-n", "2", "--logprobs", "1", "--echo", "--json").stdout)
    assert len(echoed["prompt_logprobs"]) == echoed["prompt_tokens"] and echoed["prompt_logprobs"][0]["logprob"] is None
    assert_one_line_error(jaxinfer_here("run", "def", "--echo"), "--echo", "--logprobs")

    for bad in ("21", "-1"):
        assert_one_line_error(jaxinfer_here("run", "def", "--logprobs", bad), "--logprobs")

    lines = [
        {
            "custom_id": "chat",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 2,
            },
        },
        {
            "custom_id": "plain",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": False},
        },
        {"custom_id": "legacy", "url": "/v1/completions", "body": {"prompt": "def", "max_tokens": 3, "logprobs": 1}},
        {
            "custom_id": "bad",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        },
        {
            "custom_id": "echoed",
            "url": "/v1/completions",
            "body": {"prompt": "def", "max_tokens": 3, "logprobs": 1, "echo": True},
        },
        {
            "custom_id": "echoed chat",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        },
        {"id": "ours", "prompt": "def", "max_tokens": 3, "logprobs": 0},
        {"id": "too many", "prompt": "def", "logprobs": 21},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = jaxinfer("batch", str(source), "-b", "2").stdout
    records = {r.get("custom_id", r["id"]): r for r in map(json.loads, out.splitlines())}
    chat = records["chat"]["response"]["body"]["choices"][0]
    assert len(chat["logprobs"]["content"]) == 3 and all(
        len(e["top_logprobs"]) == 2 for e in chat["logprobs"]["content"]
    )
    assert (
        "".join(bytes(b for e in chat["logprobs"]["content"] for b in e["bytes"]).decode())
        == chat["message"]["content"]
    )
    assert records["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
    legacy = records["legacy"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 3
    assert legacy["text_offset"][0] == 0
    assert "top_logprobs" in records["bad"]["error"]["message"]
    assert [e["top_logprobs"] for e in records["ours"]["logprobs"]] == [[], [], []]
    echoed = records["echoed"]["response"]["body"]["choices"][0]  # the prompt's tokens (BOS first, with none) first
    assert echoed["text"].startswith("def") and len(echoed["logprobs"]["tokens"]) > 3
    assert echoed["logprobs"]["token_logprobs"][0] is None and None not in echoed["logprobs"]["token_logprobs"][1:]
    assert "echo" in records["echoed chat"]["error"]["message"]
    assert "logprobs" in records["too many"]["error"]
