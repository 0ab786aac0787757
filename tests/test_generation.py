"""Engine behaviour: compile counts, sampling determinism, stop strings, streaming."""

import signal

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.buckets import prompt_bucket
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.runtime import watch_compiles
from jaxinfer.sampling import SamplerArrays, Sampling, sample
from jaxinfer.text import StopStrings


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny("llama"))


def generate(model, engine, prompt, **kw):
    gen = Generation(model, engine, prompt, **kw)
    pieces = list(gen)
    return gen, pieces


@pytest.mark.slow
def test_one_prefill_program_per_bucket_and_sampling_never_recompiles(model):
    # a cache length no other test uses: programs other tests compiled in this process don't count
    engine = Engine(model.config, model.params, 136, model.eos_ids)
    short, longer = model.tokenizer.encode("The capital"), model.tokenizer.encode("The capital of France is")
    assert len(short) != len(longer) and prompt_bucket(len(short), 136) == prompt_bucket(len(longer), 136)
    with watch_compiles() as first:
        generate(model, engine, short, sampling=Sampling(), max_tokens=8)
    assert first.programs == 2  # one prefill, one decode
    with watch_compiles() as later:
        generate(model, engine, longer, sampling=Sampling(), max_tokens=8)
        generate(
            model,
            engine,
            longer,
            sampling=Sampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.3),
            max_tokens=12,
            seed=1,
        )
        generate(model, engine, longer, sampling=Sampling(temperature=1.3), max_tokens=20, seed=2)
    assert later.programs == 0
    with watch_compiles() as new_bucket:
        generate(model, engine, list(range(2, 40)), sampling=Sampling(), max_tokens=4)
    assert new_bucket.programs == 1  # a new bucket: prefill only


def test_seeded_sampling_is_reproducible_and_seed_matters(model):
    engine = Engine(model.config, model.params, 128, ())
    hot = Sampling(temperature=1.0, top_p=0.95)
    runs = [generate(model, engine, "The capital", sampling=hot, max_tokens=24, seed=s)[0] for s in (7, 7, 8)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].result()["seed"] == 7


def test_sampling_filters_restrict_the_choice(model):
    engine = Engine(model.config, model.params, 128, ())
    greedy, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=16)
    for strict in (
        Sampling(temperature=1.5, top_k=1),
        Sampling(temperature=1.5, top_p=1e-6),
        Sampling(temperature=1.5, min_p=0.999),
    ):
        gen, _ = generate(model, engine, "The capital", sampling=strict, max_tokens=16, seed=3)
        assert gen.token_ids == greedy.token_ids, strict


@pytest.mark.slow
def test_top_k_holds_whatever_the_rounding_of_the_kept_mass():
    # The mass of the k kept tokens sums to just under 1 in float32 for most logits; top-p at 1
    # must not then keep the cut ones.
    logits = jax.random.normal(jax.random.key(0), (64, 1000)) * 3
    settings = SamplerArrays.from_settings([Sampling(temperature=1.0, top_k=20)] * 64)
    keys = jax.random.split(jax.random.key(1), 64)
    top20 = jax.lax.top_k(logits, 20)[1]
    for draw in range(8):
        drawn = sample(
            logits, jnp.zeros(logits.shape, bool), jax.vmap(jax.random.fold_in, (0, None))(keys, draw), settings
        )
        assert bool(jnp.all(jnp.any(top20 == drawn[:, None], axis=1)))


def test_repeat_penalty_changes_greedy_output(model):
    engine = Engine(model.config, model.params, 128, ())
    plain, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=32)
    penalised, _ = generate(model, engine, "The capital", sampling=Sampling(repeat_penalty=5.0), max_tokens=32)
    assert plain.token_ids != penalised.token_ids
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))


def test_streamed_pieces_make_the_final_text_whatever_the_chunking(model):
    engine = Engine(model.config, model.params, 128, ())
    streamed, pieces = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=40)
    whole, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=40, stream=False)
    assert "".join(pieces) == streamed.text == whole.text
    assert streamed.token_ids == whole.token_ids
    assert streamed.result()["finish_reason"] == "length"


def test_stop_string_ends_generation_and_never_leaks(model):
    engine = Engine(model.config, model.params, 128, ())
    full, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=40)
    assert len(full.text) > 12
    stop = full.text[6:12]  # a stop string that spans several tokens
    gen, pieces = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=40, stop=(stop, "never"))
    assert gen.finish_reason == "stop"
    assert gen.text == full.text[: full.text.index(stop)] == "".join(pieces)
    assert len(gen.token_ids) < len(full.token_ids)


@pytest.mark.parametrize(
    "pieces, expected_out",
    [
        (["ab", "c<", "/st", "op>tail"], "abc"),  # split across pieces
        (["ab<", "x"], "ab<x"),  # a false start is released
        (["<", "/", "s"], ""),  # a prefix is held until the end
    ],
)
def test_stop_strings_hold_back_prefixes(pieces, expected_out):
    stops = StopStrings(("</stop>",))
    out, stopped = "", False
    for p in pieces:
        text, stopped = stops.feed(p)
        out += text
        if stopped:
            break
    assert out == expected_out
    assert stops.flush() == ("" if stopped or expected_out == "ab<x" else "</s")


def _naive_stops(stops, pieces):
    """The rule StopStrings keeps, spelt out: every string looked for in all that is held."""
    held, out = "", ""
    for piece in pieces:
        held += piece
        hits = [i for i in (held.find(s) for s in stops) if i >= 0]
        if hits:
            return out + held[: min(hits)], True, ""
        keep = max((n for s in stops for n in range(1, len(s)) if held.endswith(s[:n])), default=0)
        out, held = out + held[: len(held) - keep], held[len(held) - keep :]
    return out, False, held


@given(
    st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6),
    st.lists(st.text("abcd", max_size=6), max_size=12),
)
@settings(max_examples=300, deadline=None)
def test_stop_strings_match_the_rule_spelt_out(stops, pieces):
    """Overlapping strings (one inside another, one a suffix of another) over a three-letter text."""
    matcher, out, stopped = StopStrings(tuple(stops)), "", False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out += text
        if stopped:
            break
    assert (out, stopped, "" if stopped else matcher.flush()) == _naive_stops(stops, pieces)


def test_many_long_stop_strings_cost_what_the_text_does():
    """64 strings of 256 characters that all share the text's prefixes: what was 15.8 s for 200
    tokens (5,000 strings of 100) is one step of an automaton a character."""
    import time

    stops = tuple("ab" * 100 + f"{k:056d}" for k in range(64))
    matcher, started, out = StopStrings(stops), time.perf_counter(), ""
    for _ in range(2000):
        text, stopped = matcher.feed("ab")
        out += text
        assert not stopped
    assert time.perf_counter() - started < 1.0  # ~10 ms; the per-string rule took minutes
    assert len(out) == 4000 - 200 and matcher.flush() == "ab" * 100  # a string's prefix held back


def test_eos_ends_generation(model):
    engine = Engine(model.config, model.params, 128, ())
    free, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=12)
    eos = free.token_ids[5]
    engine = Engine(model.config, model.params, 128, (eos,))
    gen, _ = generate(model, engine, "The capital", sampling=Sampling(), max_tokens=12)
    assert gen.finish_reason == "eos"
    assert gen.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]


@pytest.mark.slow
def test_cache_full_is_a_length_finish(model):
    engine = Engine(model.config, model.params, 32, ())
    prompt = model.tokenizer.encode("The capital")
    gen, _ = generate(model, engine, prompt, sampling=Sampling(), max_tokens=32 - len(prompt))
    assert gen.finish_reason == "length" and len(prompt) + len(gen.token_ids) == 32


def test_a_prompt_extending_the_cached_sequence_prefills_only_its_new_tokens(model):
    engine = Engine(model.config, model.params, 256, ())
    first, _ = generate(
        model, engine, "The capital of France is Paris, and the capital of Italy is", sampling=Sampling(), max_tokens=8
    )
    follow_up = first.prompt_ids + first.token_ids + model.tokenizer.encode(" and Spain?", add_special_tokens=False)
    second, _ = generate(model, engine, follow_up, sampling=Sampling(), max_tokens=12)
    # every token but the last generated one has its K/V in the cache (the last was never fed back)
    assert second.timings.cached_tokens == len(first.prompt_ids) + len(first.token_ids) - 1
    assert second.result()["timings"]["prefilled_tokens"] == len(follow_up) - second.timings.cached_tokens
    fresh, _ = generate(
        model, Engine(model.config, model.params, 256, ()), follow_up, sampling=Sampling(), max_tokens=12
    )
    assert fresh.timings.cached_tokens == 0
    assert second.token_ids == fresh.token_ids
    other, _ = generate(
        model, engine, "Something else entirely, from its first token on.", sampling=Sampling(), max_tokens=4
    )
    assert other.timings.cached_tokens == 0  # only the BOS in common: prefilled from scratch


def test_ctrl_c_as_a_decode_call_returns_keeps_the_cache(model):
    """Ctrl-C that lands the moment a decode call has dispatched (the state donated to it, its result
    not yet held) still leaves the engine its state: the next turn reuses the cache."""
    engine = Engine(model.config, model.params, 256, ())
    prompt = model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    compiled = engine.slots._program

    def interrupted(*args, **static):
        program = compiled(*args, **static)

        def call(*inputs):
            out = program(*inputs)
            signal.raise_signal(signal.SIGINT)  # handled before `out` is returned (and assigned)
            return out

        return call if args[0][0] == "decode" else program  # args: the key, the report, the phase, ...

    engine.slots._program = interrupted
    stream = engine.generate(prompt, Sampling(), 32, seed=0)
    with pytest.raises(KeyboardInterrupt):
        list(stream.chunks)  # the first token comes from the prefill, the interrupt with the first decode call
    engine.slots._program = compiled
    assert not engine.slots.lost
    again = engine.generate(prompt, Sampling(), 4, seed=0)
    list(again.chunks)
    assert again.timings.cached_tokens == len(prompt) - 1  # all but the last, whose logits prefill must compute
