"""Attention over the real length: decode and continuation prefill read a power-of-two prefix of the
cache (a kv bucket), and sequences that cross buckets mid-generation still match transformers, in
run (streamed and whole), chat and batch, with one program per bucket."""

import dataclasses

import jax
import pytest
from kernel_helpers import xla_dot
from reference import alone, greedy_reference, reference

from jaxinfer.buckets import MIN_KV_BUCKET, kv_bucket
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.runtime import watch_compiles
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

S = 4 * MIN_KV_BUCKET  # three kv buckets: 128, 256, 512
PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n):"


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: a sliding window of 24 inside every bucket
def models(tiny, request):
    path = tiny(request.param, max_position_embeddings=S)
    return load_model(path), reference(path)


def expected_kv_read(engine: Engine, cfg, prompt_tokens: int, generated: int) -> float:
    """Cache positions the decode steps read, summed: where XLA attends, each step the bucket of its own
    length; where a kernel does (the CPU's here), each layer its own length, within its window."""
    lengths = range(prompt_tokens + 1, prompt_tokens + generated)
    if not engine.slots.state.cache.attends(1):
        return sum(kv_bucket(length, S) for length in lengths)
    return sum(min(length, w or length) for length in lengths for w in cfg.sliding_windows) / cfg.num_layers


def test_crossing_buckets_mid_generation_matches_transformers(models):
    model, hf = models
    ids = model.tokenizer.encode(PROMPT)
    new = S - len(ids)  # to the very end of the cache: through every bucket
    expected = greedy_reference(hf, ids, new)
    engine = Engine(model.config, model.params, S, eos_ids=())
    jax.clear_caches()  # count this test's compiles, not whether an earlier test built the same programs
    with watch_compiles() as compiles:
        streamed = Generation(model, engine, ids, Sampling(), new)
        list(streamed)
    assert streamed.token_ids == expected
    assert compiles.programs == 1 + 3  # one prefill, one decode per kv bucket
    # never the whole cache before it is needed
    assert streamed.timings.kv_read == pytest.approx(expected_kv_read(engine, model.config, len(ids), new))

    with watch_compiles() as again:
        whole = Generation(model, engine, ids, Sampling(), new, stream=False)
        list(whole)
    assert whole.token_ids == expected
    # a continuation prefill; every decode program reused
    assert whole.timings.cached_tokens == len(ids) - 1 and again.programs == 1
    assert whole.timings.kv_read == pytest.approx(expected_kv_read(engine, model.config, len(ids), new))


def test_a_large_context_costs_a_short_sequence_nothing(models):
    model, _ = models
    ids = model.tokenizer.encode(PROMPT)
    small, large = Engine(model.config, model.params, S, ()), Engine(model.config, model.params, 8 * S, ())
    with xla_dot():  # XLA's attention reads whole buckets: the smallest, whatever the cache size
        einsums = Engine(model.config, model.params, 8 * S, ())
    results = []
    for engine in (small, large, einsums):
        gen = Generation(model, engine, ids, Sampling(), 40)
        list(gen)
        results.append(gen)
        assert gen.timings.kv_read == pytest.approx(expected_kv_read(engine, model.config, len(ids), 40))
    assert einsums.slots.state.cache.kernel is None and results[2].timings.kv_read == MIN_KV_BUCKET * 39
    assert results[0].token_ids == results[1].token_ids


def test_chat_continuation_crossing_a_bucket_equals_a_fresh_prefill(models):
    model, hf = models
    engine = Engine(model.config, model.params, S, ())
    first = Generation(model, engine, model.tokenizer.encode(PROMPT * 3), Sampling(), 60)
    list(first)
    follow_up = (
        first.prompt_ids
        + first.token_ids
        + model.tokenizer.encode(" and the capital of Italy?" * 4, add_special_tokens=False)
    )
    assert len(first.prompt_ids) + len(first.token_ids) < MIN_KV_BUCKET < len(follow_up)
    second = Generation(model, engine, follow_up, Sampling(), 150)
    list(second)
    assert second.timings.cached_tokens > 0  # it continued from the cache
    assert second.token_ids == greedy_reference(hf, follow_up, 150)


def test_batch_rows_crossing_buckets_equal_run(models):
    model, _ = models
    model = dataclasses.replace(model, eos_ids=())  # lengths exactly as asked
    prompts = [PROMPT, "x", PROMPT * 4, "Def fibonacci(n):"]
    reqs = [
        Request(i, model.tokenizer.encode(p), Sampling(), max_tokens=(20, 300, 150, 60)[i], seed=i)
        for i, p in enumerate(prompts)
    ]
    expected = {r.id: (gen.text, len(gen.token_ids)) for r in reqs for gen in [alone(model, r, S)]}
    out = []
    Scheduler(model, 2, S).run(reqs, out.append)
    assert {r["id"]: (r["text"], r["generated_tokens"]) for r in out} == expected
    assert all(r["generated_tokens"] == reqs[r["id"]].max_tokens for r in out)
