"""Speculative decoding by prompt lookup, inside the decode loop: the output is exactly plain
decoding's (greedy against transformers; sampled against our own plain loop with the same seed),
whatever is accepted, wherever EOS, a stop string, the budget or the cache's end falls."""

import dataclasses

import jax
import pytest
from cli_helpers import assert_one_line_error, jaxinfer, jaxinfer_here
from reference import greedy_reference, reference

from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.runtime import watch_compiles
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

S = 256  # two kv buckets
COPY = "The capital of France is Paris. The capital of Italy is Rome. " * 3 + "The capital of"  # repeats itself
OPEN = "東京 🙂 def fibonacci(n):"
SPEC = Speculation(draft=4)


def generate(model, prompt, speculation=Speculation(), n=48, context=S, **kwargs):
    engine = Engine(model.config, model.params, context, model.eos_ids, Decoding(speculation=speculation))
    gen = Generation(model, engine, prompt, kwargs.pop("sampling", Sampling()), n, **kwargs)
    list(gen)
    return gen


def check_counts(gen) -> None:
    """Every pass makes one token of its own plus the drafts it accepted."""
    spec = gen.timings.speculation
    assert spec.passes + spec.accepted == len(gen.token_ids) - 1


# one of each variant the verifying pass takes apart (it is the shared forward; test_parity holds
# every architecture to transformers): sliding windows and soft-capping (gemma2), a rope base per
# layer type and K/V shared between layers (gemma4), a mixture's draft tokens routed each to its own
# experts in one pass, a hybrid's DeltaNet state settled on the drafts it kept, attention sinks
# (longrope's factors in a verifying pass: a chunk's, test_chunked_prefill's; AltUp's: test_gemma4's)
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma4", "qwen2-moe", "qwen3.5", "gpt-oss"])
def test_greedy_is_transformers_greedy_on_every_architecture(tiny, arch):
    path = tiny(arch, init_std=0.05)  # a model whose greedy text soon cycles: drafts are accepted
    model = dataclasses.replace(load_model(path), eos_ids=())
    hf = reference(path)
    for prompt in (COPY, OPEN):
        ids = model.tokenizer.encode(prompt)
        gen = generate(model, ids, SPEC, n=64)
        assert gen.token_ids == greedy_reference(hf, ids, 64), (arch, prompt)
        check_counts(gen)
        if prompt == COPY:  # the case is only a test of verification if drafts were kept
            assert gen.timings.speculation.accepted > 0


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("llama", init_std=0.05))


def test_sampling_gives_the_same_tokens_as_plain_decoding(model):
    # Each position's token is drawn with the key of (seed, position) from the same distribution
    # (the repetition penalty sees the drafts before it), so the same seed gives the same text.
    for sampling in (Sampling(temperature=0.9, top_p=0.95), Sampling(temperature=0.7, top_k=20, repeat_penalty=1.3)):
        for seed in range(3):
            plain = generate(model, COPY, n=64, sampling=sampling, seed=seed, ignore_eos=True)
            spec = generate(model, COPY, SPEC, n=64, sampling=sampling, seed=seed, ignore_eos=True)
            assert spec.token_ids == plain.token_ids
            check_counts(spec)


def test_eos_budget_and_stop_strings_inside_accepted_runs(model):
    plain = generate(model, COPY, n=64, ignore_eos=True)
    spec = generate(model, COPY, SPEC, n=64, ignore_eos=True)
    assert spec.token_ids == plain.token_ids and spec.timings.speculation.accepted > 8
    # The budget ending at every point of the first tokens, some of them inside an accepted run.
    for n in range(1, 14):
        assert generate(model, COPY, SPEC, n=n, ignore_eos=True).token_ids == plain.token_ids[:n]
    # EOS: each distinct token of the output in turn ends the sequence at its first occurrence.
    for eos in sorted(set(plain.token_ids[1:20])):
        with_eos = dataclasses.replace(model, eos_ids=(eos,))
        spec = generate(with_eos, COPY, SPEC, n=64)
        assert spec.token_ids == plain.token_ids[: plain.token_ids.index(eos) + 1] and spec.finish_reason == "eos"
    # A stop string cut from the middle of the text.
    stop = plain.text[len(plain.text) // 2 :][:6]
    spec, again = generate(model, COPY, SPEC, n=64, stop=(stop,)), generate(model, COPY, n=64, stop=(stop,))
    assert spec.text == again.text and spec.finish_reason == again.finish_reason == "stop"


def test_the_cache_full_through_every_bucket_with_bounded_compiles(model):
    model = dataclasses.replace(model, eos_ids=())
    ids = model.tokenizer.encode(COPY)
    new = S - len(ids)  # to the very last position
    plain = generate(model, ids, n=new)
    engine = Engine(model.config, model.params, S, (), Decoding(speculation=SPEC))
    jax.clear_caches()  # count this test's compiles, not whether an earlier test built the same programs
    with watch_compiles() as compiles:
        spec = Generation(model, engine, ids, Sampling(), new)
        list(spec)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == new
    assert compiles.programs == 1 + 2  # one prefill, one decode per kv bucket, as without speculation
    check_counts(spec)
    whole = generate(model, ids, SPEC, n=new, stream=False)  # one loop per bucket: it must stop at each bucket's end
    assert whole.token_ids == plain.token_ids


def test_batch_rows_speculate_independently_of_their_mates(model):
    model = dataclasses.replace(model, eos_ids=())
    prompts = [COPY, OPEN, "x", COPY * 2]  # the last comes in 16-token chunks beside the running rows
    reqs = [
        Request(
            i,
            model.tokenizer.encode(p),
            Sampling(temperature=0.8 * (i % 2)),
            max_tokens=(40, 60, 30, 50)[i],
            seed=i,
            speculate=i != 2,
        )
        for i, p in enumerate(prompts)
    ]
    expected = {
        r.id: generate(model, r.prompt_ids, n=r.max_tokens, sampling=r.sampling, seed=r.seed).text for r in reqs
    }
    out = []
    Scheduler(model, 3, S, Decoding(16, SPEC)).run(reqs, out.append)
    assert {r["id"]: r["text"] for r in out} == expected
    records = {r["id"]: r for r in out}
    assert "speculation" not in records[2]["timings"]  # that request asked for none
    assert records[0]["timings"]["speculation"]["accepted"] > 0


def test_bundled_model_copies_exactly(tmp_path):
    model = load_model(None)
    source = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    ids = model.tokenizer.encode(source * 3)
    assert generate(model, ids, SPEC, n=64, context=512).token_ids == generate(model, ids, n=64, context=512).token_ids


def test_bench_speculates_and_reports_what_it_kept(tiny):
    import json

    proc = jaxinfer(
        "bench",
        "-m",
        tiny("llama", init_std=0.05),
        "-p",
        "16",
        "-n",
        "24",
        "-b",
        "1,2",
        "-r",
        "1",
        "--speculate",
        "ngram",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    for point in json.loads(proc.stdout)["points"]:
        spec = point["speculation"]
        assert spec["drafted"] >= spec["accepted"] > 0 and spec["tokens_per_step"] > 1
        assert point["decode_tok_s"]["median"] > 0 and point["decode"]["mbu"] > 0


def test_bad_flags_are_one_line_errors():
    assert_one_line_error(jaxinfer_here("run", "x", "--speculate", "medusa"), "--speculate", "ngram")
    assert_one_line_error(jaxinfer_here("run", "x", "--speculate", "ngram", "--num-draft", "0"), "--num-draft")
    assert_one_line_error(jaxinfer_here("run", "x", "--num-draft", "3"), "--speculate")
