"""Chat: KV-cache reuse across turns (library), and the real `jaxinfer chat` driven in a pseudo-terminal."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pexpect
import pytest

from jaxinfer.chat import ChatSession
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling

pytestmark = pytest.mark.slow  # the inner loop's `pytest -m "not slow"` leaves this file out

# Mistral's: compact enough for the tiny models' 256 positions, and it refuses a system prompt
TEMPLATE = (Path(__file__).parent / "chat_templates" / "mistral.jinja").read_text()
FOOTER = re.compile(r"prefill (\d+) tokens(?: \(\+(\d+) cached\))?, TTFT")


def with_template(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    (destination / "chat_template.jinja").write_text(TEMPLATE)
    return destination


@pytest.fixture(scope="module")
def chat_model(tiny, tmp_path_factory):
    return with_template(tiny("llama"), tmp_path_factory.mktemp("chat") / "model")


def common_prefix(a, b):
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def test_each_turn_prefills_only_what_the_cache_does_not_hold(chat_model):
    turns(chat_model)


def test_a_hybrids_turn_takes_the_last_ones_state_whole_or_not_at_all(tiny, tmp_path):
    """Qwen3.5's DeltaNet state is known only where it was kept: after all the tokens a turn left, and
    after that turn's prompt. The next turn takes the longer of the two its prompt extends (the
    prompt's, where the reply rendered again is not the tokens generated); replies as fresh."""
    turns(with_template(tiny("qwen3.5"), tmp_path / "model"))


def turns(chat_model):
    """Three turns: each prefills only what the cache holds of its prompt (on a hybrid, all of the
    last turn's tokens or all of its prompt), and replies as a fresh engine would."""
    model = load_model(chat_model)
    whole = model.config.recurrent
    engine = Engine(model.config, model.params, 256, model.eos_ids)
    session = ChatSession(model, engine, Sampling(), max_tokens=12)
    previous = asked = None  # the token sequence whose K/V the cache holds after the last turn, its prompt
    for text in ("What is the capital of France?", "And of Italy?", "Thanks, and Spain?"):
        gen, notices = session.ask(text)
        list(gen)
        session.record(gen)
        ids = gen.prompt_ids
        cached = gen.timings.cached_tokens
        if previous is None:
            assert cached == 0
        else:  # exactly the common prefix with what the cache holds (never the last prompt token)
            expected = min(common_prefix(ids, previous), len(ids) - 1)
            if whole and expected < len(previous):  # the state it kept after the last prompt
                expected = len(asked) if common_prefix(ids, asked) == len(asked) else 0
            assert cached == expected > 0
        assert gen.result()["timings"]["prefilled_tokens"] == len(ids) - cached
        # the reply is what a fresh engine gives for the same rendered prompt
        fresh = Generation(model, Engine(model.config, model.params, 256, model.eos_ids), ids, Sampling(), 12)
        list(fresh)
        assert fresh.token_ids == gen.token_ids
        previous, asked = ids + gen.token_ids[:-1], ids
        assert notices == []


def test_a_hybrid_in_the_terminal_carries_its_state_and_resets_it(tiny, tmp_path):
    """`jaxinfer chat` on Qwen3.5: the second turn takes the first's state (cached tokens), and after
    /reset the same two messages get the same two replies (no state left over from before)."""
    child = spawn(with_template(tiny("qwen3.5"), tmp_path / "model"), "-n", "8", "--temp", "0")

    def turn(text: str) -> tuple[str, int]:
        child.sendline(text)
        child.expect(FOOTER)
        shown, cached = child.before, int(child.match.group(2) or 0)  # the line echoed and the reply
        child.expect_exact(">>> ")
        return shown, cached

    first = [turn("What is the capital of France?"), turn("And of Italy?")]
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    child.expect_exact(">>> ")
    again = [turn("What is the capital of France?"), turn("And of Italy?")]
    assert [shown for shown, _ in again] == [shown for shown, _ in first]
    assert first[0][1] == again[0][1] == 0 and first[1][1] == again[1][1] > 0
    leave(child)


def test_context_full_drops_oldest_turns_or_refuses(chat_model):
    model = load_model(chat_model)
    engine = Engine(model.config, model.params, 128, model.eos_ids)
    dropping = ChatSession(model, engine, Sampling(), max_tokens=24)
    all_notices = []
    for i in range(6):
        gen, notices = dropping.ask(f"Question number {i}: what is the capital of France?")
        list(gen)
        dropping.record(gen)
        all_notices += notices
        assert len(gen.prompt_ids) + 24 <= 128
    assert any("context full" in n for n in all_notices)
    assert dropping.messages[0]["content"] != "Question number 0: what is the capital of France?"

    strict = ChatSession(model, Engine(model.config, model.params, 128, model.eos_ids), Sampling(), 24, on_full="error")
    with pytest.raises(JaxinferError, match="exceed the context"):
        for i in range(6):
            gen, _ = strict.ask(f"Question number {i}: what is the capital of France?")
            list(gen)
            strict.record(gen)
    assert strict.messages[-1]["role"] == "assistant"  # the refused message is not kept
    with pytest.raises(JaxinferError, match="too long"):
        strict.reset()
        strict.ask("Paris " * 200)


def test_stop_strings_and_ignore_eos_on_top_of_the_template(chat_model):
    model = load_model(chat_model)

    def reply(**settings):
        session = ChatSession(model, Engine(model.config, model.params, 256, model.eos_ids), Sampling(), 40, **settings)
        gen, _ = session.ask("What is the capital of France?")
        list(gen)
        return gen

    free = reply(ignore_eos=True)
    assert len(free.token_ids) == 40  # EOS off: the whole budget
    stop = free.text[6:9]
    stopped = reply(ignore_eos=True, stop=(stop,))
    assert stopped.text == free.text[: free.text.find(stop)] and stopped.finish_reason == "stop"


def test_save_and_load_round_trip_and_bad_files(chat_model, tmp_path):
    model = load_model(chat_model)
    session = ChatSession(model, Engine(model.config, model.params, 256, model.eos_ids), Sampling(), 8)
    gen, _ = session.ask("Hello")
    list(gen)
    session.record(gen)
    session.save(tmp_path / "chat.json")
    other = ChatSession(model, session.engine, Sampling(), 8)
    other.load(tmp_path / "chat.json")
    assert other.conversation() == session.conversation()
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "wizard", "content": "x"}]}')
    for path, words in ((tmp_path / "bad.json", "not a saved chat"), (tmp_path / "missing.json", "cannot read")):
        with pytest.raises(JaxinferError, match=words):
            other.load(path)


# --- the real command in a pseudo-terminal -------------------------------------------------------


def spawn(model, *args):
    child = pexpect.spawn(
        "jaxinfer",
        ["chat", "-m", str(model), *map(str, args)],
        encoding="utf-8",
        timeout=120,
        env={**os.environ, "TERM": "dumb", "COLUMNS": "200"},  # the session's program cache (conftest)
    )
    child.expect_exact(">>> ")
    return child


def say(child, text) -> tuple[int, int]:
    """Send a message; (prefilled, cached) tokens from the turn's footer."""
    child.sendline(text)
    child.expect(FOOTER)
    prefilled, cached = int(child.match.group(1)), int(child.match.group(2) or 0)
    child.expect_exact(">>> ")
    return prefilled, cached


def leave(child, how="eof"):
    """Leave by Ctrl-D ("eof"), Ctrl-C ("ctrl-c") or a command; the exit must be clean."""
    if how == "eof":
        child.sendeof()
    elif how == "ctrl-c":
        child.sendintr()
    else:
        child.sendline(how)
    child.expect(pexpect.EOF)
    assert child.wait() == 0 and "Traceback" not in child.before


def test_three_turns_commands_and_transcripts(chat_model, tmp_path):
    child = spawn(chat_model, "-n", "8", "--temp", "0", "--system", "Be brief.")
    child.sendline("Hi")  # this template takes no system prompt: a one-line error, and the session goes on
    child.expect_exact("error: chat template: Conversation roles must alternate")
    child.sendline("/system")
    child.expect_exact("system prompt removed")
    first = say(child, "What is the capital of France?")
    second = say(child, "And of Italy?")
    third = say(child, '"""\nOn two\nlines\n"""'.replace("\n", os.linesep))
    assert first[1] == 0 and 0 < second[1] < third[1]  # the exact counts: test_each_turn_prefills_only...
    child.sendline("/wat")
    child.expect_exact("unknown command /wat")
    (tmp_path / "chat.json").write_text("precious\n")
    child.sendline(f"/save {tmp_path / 'chat.json'}")
    child.expect_exact("exists")  # never replaced silently
    assert (tmp_path / "chat.json").read_text() == "precious\n"
    child.sendline(f"/save! {tmp_path / 'chat.json'}")
    child.expect_exact("saved 6 messages")
    child.sendline("/reset")
    child.expect_exact("conversation cleared")
    assert say(child, "Hello again")[1] == 0  # a cleared conversation starts from scratch
    child.sendline(f"/load {tmp_path / 'chat.json'}")
    child.expect_exact("loaded 6 messages")
    child.sendline("/stats")
    child.expect_exact("6 messages")
    leave(child, "/bye")
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["system"] is None and [m["content"] for m in saved["messages"][::2]] == [
        "What is the capital of France?",
        "And of Italy?",
        "On two\nlines",
    ]


def test_a_path_is_a_message_and_a_double_slash_sends_a_line_as_it_is(chat_model):
    child = spawn(chat_model, "-n", "4", "--temp", "0")
    say(child, "/usr/bin/python crashed, why?")
    say(child, "//help is what I typed")
    child.sendline("/stats")
    child.expect_exact("4 messages")
    child.expect_exact(">>> ")  # Ctrl-D before the prompt reads was lost once on a loaded CI machine (120 s wait)
    leave(child)


def test_context_full_notice_in_the_terminal(chat_model):
    child = spawn(chat_model, "-n", "24", "--temp", "0", "-c", "128")
    for i in range(5):
        child.sendline(f"Question number {i}: what is the capital of France?")
        child.expect(FOOTER)
        turn = child.before  # notices come before the reply
        child.expect_exact(">>> ")
        if "context full: dropped the oldest turn" in turn:
            break
    else:
        pytest.fail("no context-full notice")
    leave(child)


def test_ctrl_c_stops_a_reply_and_keeps_the_session(tiny, tmp_path):
    # bigger, so a reply takes seconds; with an EOS id it can never sample, so the reply is still going
    slow = tiny("llama", hidden_size=256, num_hidden_layers=4, max_position_embeddings=8192, eos_token_id=10**6)
    slow = with_template(slow, tmp_path / "slow")
    child = spawn(slow, "-c", "8192", "-n", "6000", "--temp", "0")
    child.sendline("Tell me a long story.")
    child.expect_exact("Tell me a long story.")  # the echo
    child.expect(r"(?s).{300}")  # decode is streaming (past its compile, which holds Ctrl-C by design)
    child.sendintr()
    interrupted = time.perf_counter()
    child.expect(FOOTER)
    assert time.perf_counter() - interrupted < 2.0
    child.expect_exact("interrupted")
    child.expect_exact(">>> ")
    child.sendline("Go on.")
    time.sleep(0.5)  # likely while its prefill compiles: JAX must not be left to crash at exit
    child.sendintr()
    child.expect(FOOTER)  # the partial reply stayed in history, and its tokens in the cache
    assert int(child.match.group(2)) > 20
    child.expect_exact(">>> ")
    leave(child, "ctrl-c")  # Ctrl-C at an empty prompt leaves cleanly
