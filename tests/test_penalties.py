"""OpenAI's presence and frequency penalties and logit_bias: greedy tokens and log-probabilities
equal to transformers' logits on the same weights put through OpenAI's documented rule
(logit − frequency × count − presence × [count > 0] + bias, counts over the generated tokens);
the same alone, in a batch beside free and speculating rows, and through `run`'s engine. vLLM's
min_tokens as transformers' min_new_tokens."""

import dataclasses

import numpy as np
import pytest
import torch
from reference import hf_logits, reference

from jaxinfer.api import Parser
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

PROMPT = "The capital of France is Paris. The capital of France is"
PENALIZED = Sampling(presence_penalty=0.7, frequency_penalty=1.3)


def openai_greedy(hf, ids: list[int], n: int, sampling: Sampling, bias: dict[int, float]) -> tuple[list, list]:
    """Greedy tokens under OpenAI's rule on transformers' logits, and each one's log-probability."""
    generated, logprobs = [], []
    for _ in range(n):
        logits = hf_logits(hf, ids + generated)[-1].astype(np.float64)
        counts = np.bincount(generated, minlength=len(logits))[: len(logits)]
        logits = logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0)
        for token, value in bias.items():
            logits[token] += value
        token = int(np.argmax(logits))
        logprobs.append(float(torch.log_softmax(torch.tensor(logits), -1)[token]))
        generated.append(token)
    return generated, logprobs


def one(scheduler: Scheduler, request: Request) -> dict:
    """The request on a row of its own (a scheduler at batch 1, speculating nowhere)."""
    records = []
    scheduler.run([dataclasses.replace(request, speculate=False)], records.append)
    return records[0]


@pytest.fixture(scope="module")
def setup(tiny):
    """transformers' model, ours, and one batch-1 scheduler over ours (its programs compile once)."""
    path = tiny("llama")
    model = load_model(path)
    return reference(path), model, Scheduler(model, 1, 128)


def test_penalties_and_bias_follow_openais_rule(setup):
    hf, model, single = setup
    ids = model.tokenizer.encode(PROMPT)
    free, _ = openai_greedy(hf, ids, 16, Sampling(), {})
    bias = {free[0]: -100.0, free[3]: 4.0}  # the first choice banned, another favoured
    expected, expected_lp = openai_greedy(hf, ids, 16, PENALIZED, bias)
    assert expected != free  # the rule changes the answer here: the test can fail
    request = Request("p", ids, PENALIZED, 16, seed=0, logit_bias=bias, logprobs=0)
    record = one(single, request)
    assert [e["token"] for e in record["logprobs"]] == [
        model.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in expected
    ]
    np.testing.assert_allclose([e["logprob"] for e in record["logprobs"]], expected_lp, atol=1e-4)
    # run's engine (run --logit-bias): the same rule, and -inf never samples its token
    engine = Engine(model.config, model.params, 128, ())
    gen = Generation(model, engine, ids, PENALIZED, 16, logit_bias=bias)
    list(gen)
    assert gen.token_ids == expected
    gen = Generation(model, engine, ids, Sampling(), 16, logit_bias={free[0]: -float("inf")})
    list(gen)
    assert (
        gen.token_ids[0] != free[0] and gen.token_ids == openai_greedy(hf, ids, 16, Sampling(), bias | {free[3]: 0})[0]
    )
    with pytest.raises(JaxinferError, match="not a token id"):
        Generation(model, engine, ids, max_tokens=4, logit_bias={model.config.sampled_ids: 1.0})


def test_a_penalized_row_beside_free_and_speculating_rows(setup):
    _, model, single = setup
    ids = model.tokenizer.encode(PROMPT)
    bias = {ids[-1]: -100.0}
    requests = [
        Request("free", ids, Sampling(), 12, seed=1, speculate=True),
        Request("penalized", ids, PENALIZED, 12, seed=2, logit_bias=bias),
        Request("sampled", ids, Sampling(temperature=0.8), 12, seed=3, speculate=True),
    ]
    records = {}
    decoding = Decoding(speculation=Speculation(draft=3))
    Scheduler(model, 3, 128, decoding).run(requests, lambda r: records.__setitem__(r["id"], r))
    assert records["penalized"]["text"] != records["free"]["text"]  # the penalties act in the batch
    for r in requests:  # each row as it is alone, without speculation (plain greedy is what it verifies against)
        assert records[r.id]["text"] == one(single, r)["text"], r.id


def test_min_tokens_is_transformers_min_new_tokens(setup):
    """vLLM's min_tokens bars EOS ids until that many tokens are made, as transformers'
    `min_new_tokens`: with the model's third greedy token as its EOS it runs past it, token for token
    transformers' greedy; beside it a row without a floor and a speculating row are unchanged."""
    hf, model, _ = setup
    ids = model.tokenizer.encode(PROMPT)
    eos = openai_greedy(hf, ids, 3, Sampling(), {})[0][2]

    def transformers_greedy(floor: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=24, min_new_tokens=floor, do_sample=False, eos_token_id=eos
            )
        return out[0, len(ids) :].tolist()

    floored, unfloored = transformers_greedy(10), transformers_greedy(0)
    assert len(unfloored) == 3 and len(floored) > 10 and eos not in floored[:10]
    made = {name: ([], []) for name in ("floored", "unfloored", "speculating")}  # tokens, finish reasons

    def client(name: str):
        return lambda tokens, logprobs, reason: (made[name][0].extend(tokens), made[name][1].append(reason))

    requests = [
        Request("floored", ids, Sampling(), 24, seed=0, min_tokens=10, on_tokens=client("floored")),
        Request("unfloored", ids, Sampling(), 24, seed=0, on_tokens=client("unfloored")),
        Request("speculating", ids, Sampling(), 24, seed=0, speculate=True, on_tokens=client("speculating")),
    ]
    scheduler = Scheduler(dataclasses.replace(model, eos_ids=(eos,)), 3, 128, Decoding(speculation=Speculation(3)))
    scheduler.run(requests, None)
    assert made["floored"][0] == floored and made["floored"][1][-1] == ("eos" if floored[-1] == eos else "length")
    assert made["unfloored"][0] == made["speculating"][0] == unfloored
    assert made["unfloored"][1][-1] == made["speculating"][1][-1] == "eos"


def test_bad_values_are_refused(setup):
    _, model, _ = setup
    parser = Parser(model, 128)
    for item, words in [
        ({"presence_penalty": 2.5}, "presence_penalty must be from -2 to 2"),
        ({"frequency_penalty": "x"}, '"frequency_penalty" must be a number'),
        ({"logit_bias": {"abc": 1}}, "not a token id"),
        ({"logit_bias": {str(model.config.sampled_ids): 1}}, "not a token id"),
        ({"logit_bias": {"5": 101}}, "from -100 to 100"),
        ({"logit_bias": [1, 2]}, "must map token ids"),
    ]:
        with pytest.raises(JaxinferError, match=words):
            parser.parse(0, {"prompt": PROMPT, **item})
    request = parser.parse(0, {"prompt": PROMPT, "logit_bias": {"5": -100}, "presence_penalty": 0.5})
    assert request.logit_bias == {5: -100.0} and request.sampling.presence_penalty == 0.5
