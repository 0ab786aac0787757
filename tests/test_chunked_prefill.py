"""Chunked prefill: a long prompt is prefilled a chunk per call, attending over what earlier chunks
cached. Alone (run, chat) the chunks run back to back and the tokens are transformers'; in a batch
they interleave with the running rows' decode steps, one chunk per step, and every row's result is
what it would be alone."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import xla_dot
from reference import alone, assert_close, greedy_reference, hf_logits, our_prompt_logits, reference

from jaxinfer import kernel
from jaxinfer import model as M
from jaxinfer.buckets import (
    PREFILL_CHUNK,
    PREFILL_CHUNK_ACCELERATOR,
    PREFILL_CHUNK_KERNEL,
    chunk_size,
    kv_bucket,
    prompt_bucket,
)
from jaxinfer.cli import options
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.model import KEY_BLOCK
from jaxinfer.runtime import CompileReport, watch_compiles
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import STALL, Admission, Decoding, Slots

S = 512
TEXT = (
    "The capital of France is Paris. 東京 🙂 "
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
)

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out


# mistral: a sliding window of 24, shorter than most chunks' reach (its chunks take every path a
# chunk without a window takes, and the window's mask; test_batch, test_hybrid and the sharded runs
# prefill llama's prompts in chunks too)
@pytest.fixture(scope="module")
def models(tiny):
    path = tiny("mistral", max_position_embeddings=S)
    return dataclasses.replace(load_model(path), eos_ids=()), reference(path)


def test_chunk_size_is_a_power_of_two_and_the_flag_states_the_default():
    assert [chunk_size(n) for n in (0, -1, 1, 16, 100, 256, 300)] == [0, 0, 16, 16, 64, 256, 256]
    # the CLI keeps jax out of its imports
    assert (
        f"[default: {PREFILL_CHUNK_KERNEL} where the CPU attention kernel runs, {PREFILL_CHUNK} elsewhere on the CPU, "
        f"{PREFILL_CHUNK_ACCELERATOR} on a GPU]" in options.PREFILL_CHUNK.help
    )


def test_the_default_chunk_is_the_attention_paths(models):
    """Unless asked, a prompt goes in chunks of 512 where the CPU kernel attends (flash attention keeps
    them cheap), of 128 where XLA CPU does (an int8 cache, a CPU without AVX-512), and up to 4096
    tokens in one pass on a GPU."""
    model, _ = models
    kernel_attends = kernel.vectorised() and model.config.head_dim in kernel.ATTENTION_HEAD_DIMS
    xla = PREFILL_CHUNK if jax.default_backend() == "cpu" else PREFILL_CHUNK_ACCELERATOR
    default = Slots(model.config, model.params, 1, S, ()).prefill_chunk
    assert default == (PREFILL_CHUNK_KERNEL if kernel_attends else xla)
    int8 = dataclasses.replace(model.config, kv_dtype="int8")
    assert Slots(int8, model.params, 1, S, ()).prefill_chunk == xla
    # asked: as asked, a power of two
    assert Slots(model.config, model.params, 1, S, (), Decoding(100)).prefill_chunk == 64


@pytest.mark.parametrize("chunk", [16, 48])  # 48 → 32: chunks that do not divide the prompt
def test_a_prompt_in_chunks_matches_transformers(models, chunk):
    model, hf = models
    ids = model.tokenizer.encode(TEXT * 4)
    assert len(ids) > 4 * chunk_size(chunk) and len(ids) % chunk_size(chunk)
    expected = greedy_reference(hf, ids, 24)
    engine = Engine(model.config, model.params, S, (), Decoding(chunk))
    with watch_compiles() as compiles:
        gen = Generation(model, engine, ids, Sampling(), 24)
        list(gen)
    assert gen.token_ids == expected
    prefills, start = set(), 0  # one program per (chunk bucket, kv bucket) the chunks reach
    while start < len(ids):
        bucket = prompt_bucket(min(len(ids) - start, chunk_size(chunk)), S)
        prefills.add((bucket, kv_bucket(start + bucket, S) if start else bucket))
        start += min(len(ids) - start, chunk_size(chunk))
    decodes = {kv_bucket(n, S) for n in range(len(ids) + 1, len(ids) + 24)}
    # a handful, whatever the prompt's length (fewer where an earlier test compiled the same shapes)
    assert 0 < compiles.programs <= len(prefills) + len(decodes) <= 6

    follow_up = ids + gen.token_ids + model.tokenizer.encode(TEXT * 2, add_special_tokens=False)
    again = Generation(model, engine, follow_up, Sampling(), 16)  # a chat turn: its new part in chunks too
    list(again)
    assert again.timings.cached_tokens > 0
    assert again.token_ids == greedy_reference(hf, follow_up, 16)


def test_chunked_and_whole_prefill_agree(models):
    model, _ = models
    ids = model.tokenizer.encode(TEXT * 3)
    outputs = []
    for chunk in (0, 16, 64):
        gen = Generation(
            model,
            Engine(model.config, model.params, S, (), Decoding(chunk)),
            ids,
            Sampling(temperature=0.8),
            32,
            seed=7,
        )
        list(gen)
        outputs.append(gen.token_ids)
    assert outputs[0] == outputs[1] == outputs[2]  # sampling keys come from positions, not calls


def test_a_long_admission_runs_a_chunk_per_decode_step(models):
    model, _ = models
    long_ids = model.tokenizer.encode(TEXT * 4)
    slots = Slots(model.config, model.params, 2, S, (), Decoding(32))
    report = CompileReport()
    slots.admit([Admission(0, model.tokenizer.encode("x"), 100, 0, Sampling())], report)
    slots.step(3, report)
    _, length, _ = slots.fetch()
    running = int(length[0])

    slots.admit([Admission(1, long_ids, 8, 1, Sampling())], report)
    assert slots.prefilling.tolist() == [False, True]  # only queued: the running row is not held up
    prefilled, rounds = 0, 0
    while prefilled < len(long_ids):  # chunks of 16 or 32, as the clock sizes them
        assert slots.beside_chunk in (16, 32)
        prefilled, rounds = prefilled + slots.beside_chunk, rounds + 1
        slots.step(64, report)
        tokens, length, done = slots.fetch()
        assert int(length[0]) == running + rounds  # one token of the running row per chunk
        assert slots.prefilling[1] == (prefilled < len(long_ids)) and bool(done[1]) == (prefilled < len(long_ids))
    assert rounds > 2
    # its first token, back on the host at once (it steps from the next round)
    assert int(length[1]) == len(long_ids) + 1
    # After the first round, which times a plain step, each round's step rode in the chunk's pass
    fused = [key for key in slots._programs._compiled if key[0] == "prefill" and key[-1]]
    decodes = [key for key in slots._programs._compiled if key[0] == "decode"]
    assert fused and decodes == [("decode", kv_bucket(running + 1, S))]
    slots.step(64, report)
    _, after, _ = slots.fetch()
    assert int(after[0]) > int(length[0]) + 1  # queue empty: decode runs whole chunks again


def test_the_chunk_beside_decoding_rows_follows_the_clock(models):
    """A round's chunks may add STALL of the running rows' decode steps: the chunk doubles while
    twice it fits, halves when it does not, between 16 and --prefill-chunk; a compile says nothing."""
    model, _ = models
    slots = Slots(model.config, model.params, 2, S, (), Decoding(64))
    step, seen = 0.05, []
    fits, over, between = (STALL * step * f for f in (0.4, 1.5, 0.7))
    for chunks_s, compiled in (
        [(fits, False)] * 3 + [(over, True), (over, False), (between, False)] + [(20 * over, False)] * 3
    ):
        slots._pace(chunks_s, step, compiled)
        seen.append(slots.beside_chunk)
    assert seen == [32, 64, 64, 64, 32, 32, 16, 16, 16]
    assert Slots(model.config, model.params, 2, S, (), Decoding(0)).beside_chunk == 0  # off: whole prompts


def test_batch_rows_with_a_chunked_admission_equal_run(models):
    model, _ = models
    reqs = [
        Request(0, model.tokenizer.encode("x"), Sampling(), max_tokens=120, seed=0),
        Request(1, model.tokenizer.encode(TEXT * 4), Sampling(temperature=0.9), max_tokens=30, seed=1),
        Request(2, model.tokenizer.encode(TEXT * 2), Sampling(), max_tokens=40, seed=2),
        Request(3, model.tokenizer.encode("def"), Sampling(), max_tokens=10, seed=3),
    ]
    expected = {r.id: (gen.text, len(gen.token_ids)) for r in reqs for gen in [alone(model, r, S)]}
    out = []
    Scheduler(model, 2, S, Decoding(16)).run(reqs, out.append)
    assert {r["id"]: (r["text"], r["generated_tokens"]) for r in out} == expected
    assert all(r["generated_tokens"] == reqs[r["id"]].max_tokens for r in out)
    itl = {r["id"]: r["timings"]["itl_ms"] for r in out}
    assert all(v["p50"] > 0 and v["max"] >= v["p50"] for v in itl.values())


def test_the_step_inside_a_chunk_on_an_int8_cache_equals_run(models):
    """An int8 cache (its scales beside it, a block at a time and for decode): the running rows' step
    riding in a chunk's pass writes and reads its own rows there too, and every row is as alone."""
    model, _ = models
    int8 = dataclasses.replace(model, config=dataclasses.replace(model.config, kv_dtype="int8"))
    reqs = [
        Request(0, int8.tokenizer.encode("x"), Sampling(), max_tokens=60, seed=0),
        Request(1, int8.tokenizer.encode("def"), Sampling(), max_tokens=4, seed=1),
        Request(2, int8.tokenizer.encode(TEXT * 3), Sampling(temperature=0.9), max_tokens=12, seed=2),  # takes 1's slot
    ]
    expected = {r.id: (gen.text, len(gen.token_ids)) for r in reqs for gen in [alone(int8, r, S)]}
    out = []
    Scheduler(int8, 2, S, Decoding(16)).run(reqs, out.append)
    assert {r["id"]: (r["text"], r["generated_tokens"]) for r in out} == expected


def test_longrope_past_the_original_context_in_chunks_and_in_a_batch(tiny):
    """phi3-longrope's original context is 48: a prompt past it takes the long factors in every
    chunk (transformers' greedy tokens); in a batch, rows that grow past it while decoding are
    prefilled again whole, in chunks beside the running rows, and each equals its run alone."""
    path = tiny("phi3-longrope", max_position_embeddings=S)
    model, hf = dataclasses.replace(load_model(path), eos_ids=()), reference(path)
    ids = model.tokenizer.encode(TEXT * 2)
    assert len(ids) > 48
    gen = Generation(model, Engine(model.config, model.params, S, (), Decoding(16)), ids, Sampling(), 16)
    list(gen)
    assert gen.token_ids == greedy_reference(hf, ids, 16)
    reqs = [
        Request(0, model.tokenizer.encode("x"), Sampling(), max_tokens=56, seed=0),  # passes 48 while decoding
        Request(1, ids, Sampling(temperature=0.9), max_tokens=12, seed=1),
        Request(2, model.tokenizer.encode(TEXT[:60]), Sampling(), max_tokens=40, seed=2),  # passes it later
    ]
    expected = {r.id: (gen.text, len(gen.token_ids)) for r in reqs for gen in [alone(model, r, S)]}
    out = []
    Scheduler(model, 2, S, Decoding(16)).run(reqs, out.append)
    assert {r["id"]: (r["text"], r["generated_tokens"]) for r in out} == expected


# sliding windows (blocks skipped below them) on the kernel; soft-capped scores too on XLA (the
# kernel's soft-capping: test_attention_kernel)
@pytest.mark.parametrize("family, attention", [("mistral", "kernel"), ("gemma2", "xla")])
def test_attention_a_key_block_at_a_time_matches_transformers(tiny, family, attention):
    """Past KEY_BLOCK keys a prompt's queries attend a block at a time, over the blocks they can see
    (the CPU kernel's blocks, or XLA's `_blockwise`): every position's logits are transformers' (one
    prefill of 1124 tokens over 2048 keys), and so are the greedy tokens after 128-token chunks (kv
    buckets of 1024 and 2048 keys, read up to the chunk). On XLA, an int8 cache gives, block by
    block, what the whole-sequence path gives with the same int8 keys."""
    if attention == "kernel" and not kernel.vectorised():
        pytest.skip("the attention kernel does not run on this CPU")
    S = 4 * KEY_BLOCK
    path = tiny(family, max_position_embeddings=S)
    with xla_dot() if attention == "xla" else contextlib.nullcontext():
        model, hf = dataclasses.replace(load_model(path), eos_ids=()), reference(path)
        ids = model.tokenizer.encode(TEXT * 40)[: 2 * KEY_BLOCK + 100]
        assert len(ids) == 2 * KEY_BLOCK + 100 and prompt_bucket(len(ids), S) == S
        assert_close(our_prompt_logits(model, ids, S)[0], hf_logits(hf, ids))
        gen = Generation(model, Engine(model.config, model.params, S, (), Decoding(128)), ids, Sampling(), 8)
        list(gen)
        assert gen.token_ids == greedy_reference(hf, ids, 8)
        if attention == "xla":
            int8 = dataclasses.replace(model, config=dataclasses.replace(model.config, kv_dtype="int8"))
            whole, _ = M.forward(
                model.params, int8.config, jnp.asarray([ids]), jnp.arange(len(ids))[None], None, len(ids)
            )
            # The two paths' projections round differently, so a key can land one int8 step apart: 1e-3
            # (measured 1.6e-4 on gemma2) still fails a block skipped or attended twice by orders of magnitude.
            ours, theirs = our_prompt_logits(int8, ids, S)[0], M.logits(model.params, whole, int8.config)[0]
            assert_close(ours, np.asarray(theirs), rel=1e-3)
