"""Hybrids of Gated DeltaNet and attention (Qwen3-Next, Qwen3.5): the delta rule against
transformers' own two forms, the state carried through chunked prefill, chat turns, a batch, a
mesh, speculation and draft models (a hybrid's and a dense one's), and kept where it can be reused
(a turn's end, a prompt's, a mark where prompts share a system prompt, through the scheduler and the
server). Logits and greedy text against transformers per architecture are test_parity's (its
ARCHITECTURES include them)."""

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
from cli_helpers import assert_one_line_error, jaxinfer_here
from reference import alone, greedy_reference, our_prompt_logits, reference
from test_server import WAIT_S, Served
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from jaxinfer import forms
from jaxinfer.buckets import common_prefix
from jaxinfer.convert import convert
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.layers import delta_net
from jaxinfer.loading import load_model
from jaxinfer.modeldir import LAYOUT_KEY
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Inbox, Request, Scheduler, _mark_at
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

PROMPT = "The capital of France is Paris. 東京 🙂 def fibonacci(n): " * 4  # 90 tokens: two chunks of the rule


def _inputs(R=2, T=150, H=4, Hk=2, dk=16, dv=8, seed=0):
    """Random q, k, v, decay and β as the layer hands them to the rule (k, q of Hk key heads), and
    an initial state."""
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(R, T, Hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(R, T, H, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, size=(R, T, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(R, T, H)).astype(np.float32)
    state = rng.normal(size=(R, H, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def _ours(q, k, v, g, beta, state, recurrent=False):
    """Our rule on the same inputs: l2-normalised, q scaled, key heads repeated, as `delta_net.mix`."""
    H, dk = v.shape[2], q.shape[-1]
    q, k = (jnp.repeat(delta_net._l2norm(jnp.asarray(t)), H // t.shape[2], axis=2) for t in (q, k))
    q = q * dk**-0.5
    if not recurrent:
        return delta_net.chunked(q, k, v, g, beta, state)
    outs = []
    for t in range(q.shape[1]):
        out, state = delta_net.recurrent(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    return jnp.stack(outs, 1), state


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_the_delta_rule_is_transformers_in_both_forms(T):
    """Ours chunked and token by token, transformers' chunked (`torch_chunk_gated_delta_rule`) and
    recurrent forms: outputs and final state within float32 rounding, from a non-zero state."""
    inputs = _inputs(T=T)
    torched = [torch.from_numpy(x) for x in inputs]
    kwargs = dict(initial_state=torched[-1], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf_next.torch_chunk_gated_delta_rule(*torched[:5], **kwargs)
    slow_out, slow_state = hf_next.torch_recurrent_gated_delta_rule(*torched[:5], **kwargs)
    np.testing.assert_allclose(slow_out.numpy(), ref_out.numpy(), atol=1e-4)
    for recurrent in (False, True):
        out, state = _ours(*inputs, recurrent=recurrent)
        np.testing.assert_allclose(np.asarray(out), ref_out.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(state), ref_state.numpy(), atol=1e-4, rtol=1e-4)


def test_padding_with_no_decay_and_no_write_leaves_the_state_as_it_was():
    """A prompt's bucket padding (g = β = 0, `delta_net.mix`'s `live`): the state after 37 tokens
    and 27 of padding is the state after the 37."""
    q, k, v, g, beta, state = _inputs(T=64)
    live = np.arange(64) < 37
    _, padded = _ours(q, k, v, g * live[:, None], beta * live[:, None], state)
    _, short = _ours(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(short), atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 16, 32])
def test_chunked_prefill_and_a_second_turn_are_transformers_greedy(tiny, chunk):
    """A prompt of 90 tokens in one call (two chunks of the rule), or in prefill chunks of 16 and 32
    (the state carried between calls, each bucket's padding left out of it); then a chat's second
    turn prefilled from the state the first left: each turn transformers' greedy tokens, the second
    reusing all of the first."""
    path = tiny("qwen3-next")
    hf, model = reference(path), load_model(path)
    engine = Engine(model.config, model.params, 256, eos_ids=(), decoding=Decoding(prefill_chunk=chunk))
    ids = model.tokenizer.encode(PROMPT)
    first = Generation(model, engine, ids, Sampling(), max_tokens=12)
    list(first)
    assert first.token_ids == greedy_reference(hf, ids, 12)
    follow = ids + first.token_ids + model.tokenizer.encode(" Rome is", add_special_tokens=False)
    second = Generation(model, engine, follow, Sampling(), max_tokens=8)
    list(second)
    assert second.token_ids == greedy_reference(hf, follow, 8)
    assert second.timings.cached_tokens == len(ids) + 11  # all the first turn's but its last token


def test_a_prefix_is_reused_only_where_the_state_is_known(tiny):
    """A row's recurrent state is known after all the tokens it holds, not at any earlier position:
    a prompt that extends them takes them all; one that shares only part of them (the same prompt
    asked again, shorter than what the row went on to hold) is prefilled whole. Both give their
    tokens alone."""
    model = dataclasses.replace(load_model(tiny("qwen3.5")), eos_ids=())
    ids = model.tokenizer.encode(PROMPT)
    scheduler, out, first = Scheduler(model, 2, 256), [], Request(0, ids, Sampling(), 8, 0)
    scheduler.run([first], out.append, True)
    extended = ids + alone(model, first, 256).token_ids + model.tokenizer.encode(" Rome", add_special_tokens=False)
    again = [Request(1, extended, Sampling(), 6, 0), Request(2, ids, Sampling(), 6, 0)]
    scheduler.run(again, out.append, True)
    results = {r["id"]: r for r in out}
    assert results[1]["cached_tokens"] == len(ids) + 7 and results[2]["cached_tokens"] == 0
    for request in again:
        assert results[request.id]["text"] == alone(model, request, 256).text


def test_a_shared_system_prompt_is_taken_from_a_mark(tiny):
    """A server's clients: one system prompt, each their own question. The second prompt shares
    more with the first than the first's row kept a state for, so it marks where they part and its
    row keeps its state there as the prefill passes it; the third takes that prefix from the
    second's row while it runs (K/V copied, the state restored from the mark), the fourth from the
    row the third left. Requests arriving together on cold rows: the first marks where it parts
    from the others waiting, and they wait a step to take its mark. Every text as alone."""
    model = dataclasses.replace(load_model(tiny("qwen3.5")), eos_ids=())
    system = model.tokenizer.encode(PROMPT)
    questions = [(" Rome?", 6), (" Berlin? And then", 40), (" Madrid?", 6), (" Lisbon?", 6)]
    asked = [
        Request(i, system + model.tokenizer.encode(q, add_special_tokens=False), Sampling(), n, i)
        for i, (q, n) in enumerate(questions)
    ]
    shared = common_prefix(asked[1].prompt_ids, asked[0].prompt_ids)
    scheduler, out, inbox = Scheduler(model, 2, 256, Decoding(prefill_chunk=16)), [], Inbox()
    scheduler.run(asked[:1], out.append)
    inbox.put(asked[1])
    scheduler.turn(inbox, out.append)  # the second is admitted, prefilled and running
    inbox.put(asked[2])
    while len(out) < 3:
        scheduler.turn(inbox, out.append)
    scheduler.run(asked[3:], out.append)
    # Arriving together on rows that hold nothing: the first marks where it parts from those
    # waiting, which wait a step for its mark.
    scheduler.forget()
    together = [dataclasses.replace(r, id=r.id + 4) for r in asked[1:]]
    scheduler.run(together, out.append)
    records = {r["id"]: r for r in out}
    cached = [records[r.id]["cached_tokens"] for r in asked + together]
    again = common_prefix(together[1].prompt_ids, together[0].prompt_ids)
    assert cached == [0, 0, shared, shared, 0, again, again] and min(shared, again) > len(system) - 2
    for request in asked + together:
        assert records[request.id]["text"] == alone(model, request, 256).text


@pytest.mark.slow
def test_the_server_takes_a_shared_system_prompt_from_a_mark(tiny):
    """Through `jaxinfer serve` (the scheduler behind HTTP): a question asked cold; two clients after
    it with the same system prompt, the second taking it from the first's mark; the cold question
    asked again takes it too, and answers as it did cold."""
    served = Served("-m", tiny("qwen3.5"), "-b", "2", "-c", "256")
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", timeout=WAIT_S, max_retries=0)
        ask = lambda q: client.completions.create(model="any", prompt=PROMPT + q, max_tokens=8, temperature=0)  # noqa: E731
        answers = [ask(q) for q in ("Madrid?", "Rome?", "Berlin?", "Madrid?")]
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
        assert cached[:2] == [0, 0] and cached[2] == cached[3] > 80
        assert answers[3].choices[0].text == answers[0].choices[0].text
    finally:
        assert served.stop() == 128 + signal.SIGTERM and "Traceback" not in "".join(served.stderr)


def test_a_mark_is_where_most_is_shared():
    """Where a prompt is marked: the length it shares with others that saves most over all of them
    (a system prompt all share, not the word one of them shares too; not a short common opening
    where two share a long prompt)."""
    system = list(range(100, 190))
    ask, opening = system + [7, 8, 9], system[:20]
    assert _mark_at(ask, [system + [7, 5], system + [4]]) == len(system)
    assert _mark_at(ask, [system + [7, 8, 5], system + [7, 8, 6]]) == len(system) + 2
    assert _mark_at(ask, [system + [4], opening + [5] * 20, opening + [6] * 20]) == len(system)
    assert _mark_at(ask, [opening + [5] * 20, opening + [6] * 20]) == len(opening)
    assert _mark_at(ask, []) == 0


@pytest.mark.slow
def test_a_batch_of_hybrid_rows_gives_what_each_row_gives_alone(tiny):
    """Continuous batching (prompts prefilled in chunks beside running rows, finished rows passed by
    while others step): each row's text as alone."""
    model = dataclasses.replace(load_model(tiny("qwen3.5-moe")), eos_ids=())
    prompts = ["The capital of France is", "Def fibonacci(n):", PROMPT, "x"]  # "x": fewer tokens than the convolution
    reqs = [Request(i, model.tokenizer.encode(p), Sampling(), 6 + 5 * (i % 3), i) for i, p in enumerate(prompts)]
    out = []
    Scheduler(model, 3, 256, Decoding(prefill_chunk=16)).run(reqs, out.append, True)
    assert {r["id"]: r["text"] for r in out} == {r.id: alone(model, r, 256).text for r in reqs}


def test_a_quantized_hybrid_stays_close(tiny):
    """int8 on every matrix, the DeltaNet's projections included: the next token the float model's at
    ≥ 85% of a prompt's positions, the logits within 10% of their range."""
    path = tiny("qwen3-next")
    plain, int8 = load_model(path), load_model(path, quantize="int8")
    ids = plain.tokenizer.encode(PROMPT)
    exact, quantized = our_prompt_logits(plain, ids, 128)[0], our_prompt_logits(int8, ids, 128)[0]
    assert np.mean(exact.argmax(-1) == quantized.argmax(-1)) >= 0.85
    assert np.abs(exact - quantized).max() <= 0.1 * np.abs(exact).max()


def test_speculation_settles_the_state_on_the_drafts_it_keeps(tiny):
    """Prompt lookup on a hybrid: a verifying pass feeds K drafts, and each row's DeltaNet state moves
    over only those it kept (`DeltaState.settle`). Sampled rows and a batch with a row that does not
    speculate give plain decoding's tokens, drafts having been kept."""
    model = dataclasses.replace(load_model(tiny("qwen3.5", init_std=0.05)), eos_ids=())
    copy = model.tokenizer.encode(
        "The capital of France is Paris. The capital of Italy is Rome. " * 3 + "The capital of"
    )
    spec = Decoding(16, Speculation(draft=4))
    reqs = [
        Request(
            i, copy if i != 1 else model.tokenizer.encode(PROMPT), Sampling(temperature=0.8 * i), 64, i, speculate=True
        )
        for i in range(3)
    ]
    reqs.append(Request(3, copy, Sampling(), 30, 3, speculate=False))
    out = []
    Scheduler(model, 3, 256, spec).run(reqs, out.append, True)
    records = {r["id"]: r for r in out}
    assert {i: r["text"] for i, r in records.items()} == {r.id: alone(model, r, 256).text for r in reqs}
    assert records[0]["timings"]["speculation"]["accepted"] > 0


@pytest.mark.parametrize("drafter", ["hybrid", "dense"])
def test_a_draft_model_for_a_hybrid_and_a_hybrid_drafting(tiny, drafter):
    """A hybrid drafting (Qwen3.5's small model for its larger kin): the model with noise on its
    output head, its own layers with drafts sometimes wrong. Its DeltaNet state is after exactly
    the row's tokens but the last two (each verifying pass settles it over the drafts kept), and
    stays so through a chat's turns: the second reusing all the first held, the third only the
    second's prompt (the state kept there), the draft caught up by a token each time. A dense
    draft for a hybrid: the target's state where the turn goes on, not a token taken twice. Every
    turn's tokens are plain decoding's."""
    path = tiny("qwen3.5", init_std=0.05)
    target = dataclasses.replace(load_model(path), eos_ids=())
    if drafter == "hybrid":
        draft = dataclasses.replace(load_model(path), eos_ids=())
        head = draft.params["lm_head"].w
        noise = 0.6 * jnp.std(head) * jax.random.normal(jax.random.key(0), head.shape)
        draft.params["lm_head"] = forms.Plain(head + noise)
    else:
        draft = dataclasses.replace(load_model(tiny("llama", init_std=0.05)), eos_ids=())
    engine = Engine(
        target.config, target.params, 256, (), Decoding(16, Speculation(4, model=draft.config), draft.params)
    )
    more = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts, cached, drafted, accepted = [target.tokenizer.encode(PROMPT)], [0], 0, 0
    for turn in range(3):
        plain = Generation(target, Engine(target.config, target.params, 256, ()), prompts[-1], Sampling(), 16)
        ours = Generation(target, engine, prompts[-1], Sampling(), 16)
        list(plain), list(ours)
        assert ours.token_ids == plain.token_ids and ours.timings.cached_tokens == cached[-1]
        drafted, accepted = drafted + ours.timings.speculation.drafted, accepted + ours.timings.speculation.accepted
        row = prompts[-1] + ours.token_ids
        if drafter == "hybrid":  # the draft's state: a plain row's that has taken all but the last two
            fresh = Engine(target.config, target.params, 256, ())
            list(Generation(target, fresh, row[:-2], Sampling(), 1))
            held, expected = engine.slots.state.draft_cache.delta, fresh.slots.state.cache.delta
            for ours_layer, plain_layer in zip(held.conv + held.recurrent, expected.conv + expected.recurrent):
                np.testing.assert_allclose(ours_layer[0], plain_layer[0], atol=1e-4)
        # the second turn after all the first held (but its last token); the third after the second's prompt
        prompts.append(row + more(" Rome is") if turn == 0 else prompts[-1] + more(" Paris"))
        cached.append(len(row) - 1 if turn == 0 else len(prompts[-2]))
    if drafter == "hybrid":
        assert 0 < accepted < drafted


@pytest.mark.slow
def test_a_hybrid_over_devices_gives_one_devices_tokens(tiny):
    """Over 2 CPU devices (in a process of their own: `tests/sharded.py`), attention split by heads and
    the DeltaNet layers by key heads, their weights and state alike (Qwen3.5's projections reordered at
    load to lie by key head): a batch that speculates gives one device's greedy text."""
    path = str(tiny("qwen3.5"))
    proc = subprocess.run(
        [sys.executable, Path(__file__).with_name("sharded.py"), "--hybrid", path],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    one, two = json.loads(proc.stdout)[path].values()
    assert two["text"] == one["text"] and one["text"]
    # all but the gated norms' weights split in two
    assert len(two["delta_bytes"]) == 2 and max(two["delta_bytes"]) < 0.51 * one["delta_bytes"][0]
    assert two["state"] == ["P(None, None, 'tensor')", "P(None, 'tensor')"]
    assert one["counted"] == one["held"] and two["counted"] == two["held"]  # info's and the memory check's sums


def test_a_converted_hybrid_holds_its_rows_by_key_head(tiny, tmp_path):
    """The orbax copy holds the DeltaNet's rows as the layer does (by key head, reordered once at
    load): it gives the checkpoint's tokens. A copy converted before that layout (no layout key) is
    refused in one line, not run with its channels in the wrong places."""
    path = tiny("qwen3.5")
    converted = convert(path, tmp_path / "converted")
    request = Request(0, load_model(path).tokenizer.encode(PROMPT), Sampling(), 8, 0)
    tokens = [alone(dataclasses.replace(load_model(p), eos_ids=()), request).token_ids for p in (path, converted)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
    config = json.loads((converted / "config.json").read_text())
    del config[LAYOUT_KEY]
    (converted / "config.json").write_text(json.dumps(config))
    assert_one_line_error(jaxinfer_here("run", "-m", converted, "hi"), "earlier jaxinfer", "convert the original again")


def test_the_state_is_counted_once_a_step(tiny):
    """The roofline: a hybrid's decode step reads and writes each row's DeltaNet state (float32
    matrices, the convolution's last inputs) and K/V of its attention layers only."""
    from jaxinfer import roofline

    cfg = load_model(tiny("qwen3.5")).config
    facts = json.loads(jaxinfer_here("info", "-m", tiny("qwen3.5"), "-c", "256", "--json").stdout)
    # `info` says it beside the KV cache: held three times (kept after the last prompt and at the mark too)
    assert facts["state_bytes_per_row"] == 3 * delta_net.state_bytes(cfg, 4) == 3 * 9600
    assert facts["total_bytes"] == facts["stored_weight_bytes"] + 256 * facts["kv_bytes_per_token"] + 3 * 9600
    storage = roofline.Storage(4)
    per_row = delta_net.state_bytes(cfg, 4)
    assert per_row == 3 * (3 * 96 * 4 + 4 * 16 * 8 * 4)  # 3 DeltaNet layers: conv [3, 2·2·16 + 4·8], state [4, 16, 8]
    assert roofline.kv_bytes_per_token(cfg, storage) == 2 * 1 * 2 * 32 * 4  # one attention layer
    at_8, at_16 = (roofline.decode_step_cost(cfg, storage, 128, batch=b).bytes for b in (8, 16))
    assert at_16 - at_8 == pytest.approx(8 * (2 * per_row + roofline.kv_bytes_per_token(cfg, storage) * 129), rel=0.05)


def test_the_text_model_of_a_multimodal_checkpoint(tmp_path):
    """`Qwen3_5ForConditionalGeneration` as the hub ships Qwen3.5 (its text model under
    model.language_model, a vision tower beside it): loaded without the vision tower, said once on
    stderr, and its logits over a text prompt transformers' within float32 rounding."""
    import transformers
    from tiny_models import HYBRID, bpe_tokenizer

    bpe_tokenizer(tmp_path)
    text = dict(
        **HYBRID,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=0,
        eos_token_id=1,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    hf.eval().save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = model.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    ours = our_prompt_logits(model, ids, 128)[0]
    assert np.abs(ours - expected).max() <= 1e-4 * np.abs(expected).max()
    result = jaxinfer_here("run", "-m", tmp_path, "-n", "4", "--temp", "0", "hello")
    assert result.returncode == 0 and result.stderr.count("vision tower") == 1


def test_constrained_output_and_logprobs_on_a_hybrid(tiny):
    """The CLI's constraints and log-probabilities ride on the same programs: a choice is one of its
    options, the first token's alternatives carry the probability mass of the options' first tokens."""
    path = tiny("qwen3.5")
    result = jaxinfer_here("run", "-m", path, "--choice", "yes,no,maybe", "--logprobs", "5", "--json", "Is it?")
    record = json.loads(result.stdout)
    assert result.returncode == 0 and record["text"] in ("yes", "no", "maybe")
    first = record["logprobs"][0]["top_logprobs"]
    assert abs(sum(np.exp(a["logprob"]) for a in first) - 1) < 1e-4
