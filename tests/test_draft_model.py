"""Speculative decoding with a draft model (`--draft-model`): the output is exactly plain decoding's
(greedy against transformers, sampled against our own plain loop with the same seed), whatever the
draft proposes. A draft that is the model itself must have every draft kept: that proves its cache
holds exactly the row's tokens through admission, chunked prefill, verification, plain steps and a
chat's reused prefix."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here
from reference import greedy_reference, reference

from jaxinfer import forms
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import check_draft, load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

S = 256  # two kv buckets
PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n):"
SAMPLED = Sampling(temperature=0.8, top_p=0.95)


def generate(model, prompt, draft=None, n=48, engine=None, **kwargs):
    """`draft`: the LoadedModel drafting for `model`, or None for plain decoding."""
    spec = dict(speculation=Speculation(draft=4, model=draft.config), draft_params=draft.params) if draft else {}
    engine = engine or Engine(model.config, model.params, S, model.eos_ids, Decoding(16, **spec))
    ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    gen = Generation(model, engine, ids, kwargs.pop("sampling", Sampling()), n, **kwargs)
    list(gen)
    return gen


@pytest.fixture(scope="module")
def models(tiny):
    """The model; the same with noise on its output head (its own K/V, but drafts that are sometimes
    wrong); and a smaller model with the same tokenizer (one layer) to draft for it."""
    path = tiny("llama", init_std=0.05)
    target = dataclasses.replace(load_model(path), eos_ids=())
    near = dataclasses.replace(load_model(path, layout="out_in"), eos_ids=())
    head = near.params["lm_head"].w
    noise = 0.6 * jnp.std(head) * jax.random.normal(jax.random.key(0), head.shape)
    near.params["lm_head"] = forms.Plain(head + noise)
    small = dataclasses.replace(load_model(tiny("llama", init_std=0.05, num_hidden_layers=1)), eos_ids=())
    return target, near, small


def test_greedy_is_transformers_greedy_whatever_the_draft(models, tiny):
    target, near, _ = models
    ids = target.tokenizer.encode(PROMPT)
    expected = greedy_reference(reference(tiny("llama", init_std=0.05)), ids, 120)  # past the first kv bucket
    # The near draft (the small model's drafts are checked by the sampled test, a draft of itself by
    # every test below): some drafts kept, some not.
    engine = Engine(
        target.config,
        target.params,
        S,
        (),
        Decoding(16, Speculation(4, model=near.config), near.params),
    )
    gen = generate(target, ids, n=120, engine=engine)
    assert gen.token_ids == expected
    spec = gen.timings.speculation
    assert spec.passes + spec.accepted == len(gen.token_ids) - 1  # a pass's own token and the drafts it kept
    assert 0 < spec.accepted < spec.drafted
    # The same K/V as the model's: the draft's cache holds the row's tokens but the last two.
    held = len(ids) + len(gen.token_ids) - 2
    state = engine.slots.state
    axis = 3 if state.cache.kernel == "cpu" else 2  # positions: [L, R, KV, S, hd] on the CPU kernel
    for ours, drafts in ((state.cache.k[0], state.draft_cache.k[0]), (state.cache.v[0], state.draft_cache.v[0])):
        np.testing.assert_allclose(np.take(drafts, range(held), axis), np.take(ours, range(held), axis), atol=1e-5)


def test_sampled_rows_keep_the_same_tokens_and_a_draft_of_itself_is_always_kept(models):
    target, _, small = models
    for seed in range(2):
        plain = generate(target, PROMPT, n=64, sampling=SAMPLED, seed=seed)
        for draft in (small, target):
            gen = generate(target, PROMPT, draft, n=64, sampling=SAMPLED, seed=seed)
            assert gen.token_ids == plain.token_ids
        # Each draft is drawn with the key its position is verified with: the same distribution
        # and the same uniform give the same token, so a sampled row keeps all its drafts too.
        assert gen.timings.speculation.accepted == gen.timings.speculation.drafted > 0


def test_a_chat_turn_reuses_both_caches(models):
    target, _, _ = models
    spec = dict(speculation=Speculation(draft=4, model=target.config), draft_params=target.params)
    engine = Engine(target.config, target.params, S, (), Decoding(16, **spec))
    first = generate(target, PROMPT, n=40, engine=engine)
    follow_up = first.prompt_ids + first.token_ids + target.tokenizer.encode(" and then")
    second = generate(target, follow_up, n=40, engine=engine)
    assert second.timings.cached_tokens >= len(first.prompt_ids) + len(first.token_ids) - 2
    assert second.token_ids == generate(target, follow_up, n=40).token_ids
    assert second.timings.speculation.accepted == second.timings.speculation.drafted > 0


def test_batch_rows_draft_independently_of_their_mates(models):
    target, near, _ = models
    prompts = [PROMPT, "x", "def f(a):", PROMPT * 4]  # the last comes in 16-token chunks beside the running rows
    reqs = [
        Request(
            i,
            target.tokenizer.encode(p),
            SAMPLED if i % 2 else Sampling(),
            max_tokens=(40, 60, 30, 50)[i],
            seed=i,
            speculate=i != 2,
        )
        for i, p in enumerate(prompts)
    ]
    expected = {
        r.id: generate(target, r.prompt_ids, n=r.max_tokens, sampling=r.sampling, seed=r.seed).text for r in reqs
    }
    out = []
    spec = dict(speculation=Speculation(draft=3, model=near.config), draft_params=near.params)
    Scheduler(target, 3, S, Decoding(16, **spec)).run(reqs, out.append)
    assert {r["id"]: r["text"] for r in out} == expected
    records = {r["id"]: r for r in out}
    assert "speculation" not in records[2]["timings"]
    drafting = [records[i]["timings"]["speculation"] for i in (0, 1, 3)]
    assert 0 < sum(d["accepted"] for d in drafting) < sum(d["drafted"] for d in drafting)


def test_a_draft_with_another_vocabulary_is_refused(tiny, models):
    other = load_model(tiny("llama", tokenizer="sentencepiece"))
    with pytest.raises(JaxinferError, match="vocabulary"):
        check_draft(models[0], other)
    check_draft(models[0], models[2])


def test_the_cli_drafts_with_a_model(tiny, models):
    target, draft = tiny("llama", init_std=0.05), tiny("llama", init_std=0.05, num_hidden_layers=1)
    proc = jaxinfer(
        "run",
        "-m",
        target,
        PROMPT,
        "-n",
        "40",
        "--temp",
        "0",
        "--ignore-eos",
        "--json",
        "--draft-model",
        draft,
        "--num-draft",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["text"] == generate(models[0], PROMPT, n=40).text and result["timings"]["speculation"]["drafted"] > 0
    assert_one_line_error(
        jaxinfer("run", "-m", target, "x", "--draft-model", tiny("llama", tokenizer="sentencepiece")), "vocabulary"
    )
    assert_one_line_error(jaxinfer_here("run", "x", "--speculate", "ngram", "--draft-model", target), "--draft-model")
