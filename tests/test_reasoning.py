"""Thinking models: their reasoning read apart from the answer (as llama.cpp's `--reasoning-format
auto` reads it), the template's switch reached by `chat_template_kwargs` and `--reasoning-budget 0`
(rendered as transformers renders it), and the real CLI giving the reasoning apart (the server's
check is in test_protocols.py, beside the other protocols on the same server)."""

import json
import os
import re
from pathlib import Path

import pexpect
import pytest
import transformers
from cli_helpers import jaxinfer
from test_chat import FOOTER
from test_server import WAIT_S
from test_tools import TEMPLATES, WEATHER

from jaxinfer.chat_template import ChatOptions, ChatTemplate
from jaxinfer.errors import JaxinferError
from jaxinfer.replies import Reading, think_markers
from jaxinfer.tokenizer import Tokenizer

QWEN3 = Path(__file__).parent / "data" / "thinking" / "qwen3.jinja"  # in Qwen3's way, written for these tests
R1 = QWEN3.with_name("deepseek-r1.jinja")
GEMMA4 = QWEN3.with_name("gemma4.jinja")  # in Gemma 4's way: a thought channel, written for these tests
THINK = ("<think>", "</think>")
THOUGHT = ("<|channel>thought", "<channel|>")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (reading, reply, reasoning, content, calls)
REPLIES = [
    (Reading(None, THINK), "<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "Hello!", 0),
    (Reading(None, THINK), "Hello, no block.", None, "Hello, no block.", 0),
    (Reading(None, THINK), "<think>\n\n</think>\n\nHello!", None, "Hello!", 0),  # the empty block: thinking off
    (Reading(None, THINK), "<think>\nStill thinking when cut", "Still thinking when cut", None, 0),
    (
        Reading(None, THINK, opened=True),
        "The prompt opened it.\n</think>\n\nAnswer.",
        "The prompt opened it.",
        "Answer.",
        0,
    ),
    (Reading(None, THINK, opened=True), "<think>\nWritten again.</think>Answer.", "Written again.", "Answer.", 0),
    (Reading(None, THINK, opened=True), "Never closed.", "Never closed.", None, 0),
    (Reading("hermes", THINK), "<think>\nCall it.\n</think>\n\n" + CALL, "Call it.", None, 1),
    (Reading("hermes", THINK), "<think>\nCall it.\n</think>\n\nLet me see.\n" + CALL, "Call it.", "Let me see.", 1),
    (Reading(None, ("[THINK]", "[/THINK]")), "[THINK]Hmm.[/THINK]Bonjour.", "Hmm.", "Bonjour.", 0),
    (Reading(None, None), "<think>\nformat none\n</think>\n\nHi", None, "<think>\nformat none\n</think>\n\nHi", 0),
    (Reading(None, THOUGHT), "<|channel>thought\nThe user greets.<channel|>Hello!", "The user greets.", "Hello!", 0),
    (Reading(None, THOUGHT), "<|channel>thought\n<channel|>Hello!", None, "Hello!", 0),
]


@pytest.mark.parametrize("reading, text, reasoning, content, calls", REPLIES)
def test_a_reply_reads_into_reasoning_and_answer(reading, text, reasoning, content, calls):
    got_reasoning, got_content, got_calls = reading.reply(text)
    assert (got_reasoning, got_content, len(got_calls)) == (reasoning, content, calls)
    assert all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in got_calls)


@pytest.mark.parametrize("reading, text", [r[:2] for r in REPLIES])
def test_what_streams_only_grows_and_ends_as_the_reply(reading, text):
    """Cut after every character (a token may end mid-marker): the reasoning and answer shown so far
    only grow, never show a marker, and end as the whole reply reads."""
    shown = ("", "")
    for n in range(len(text) + 1):
        now = reading.visible(text[:n])
        assert now[0].startswith(shown[0]) and now[1].startswith(shown[1]), (text[:n], shown, now)
        if reading.think:
            assert not any(m in now[0] for m in reading.think), now
        shown = now
    reasoning, content, calls = reading.reply(text)
    assert shown[0] == (reasoning or "")
    assert (shown[1].rstrip() if calls else shown[1]) == (content or "")  # hermes: the gap before a call is dropped


def test_the_markers_are_the_templates():
    assert think_markers(QWEN3.read_text()) == THINK == think_markers(R1.read_text())
    assert think_markers(GEMMA4.read_text()) == THOUGHT
    assert think_markers((TEMPLATES / "qwen2.5.jinja").read_text()) is None


def test_a_markers_special_tokens_stay_in_the_text(tiny, tmp_path):
    """Gemma 4's `<|channel>thought` is a special token and a word: decoding keeps the special one's
    text (it drops other special tokens), so the reply reads apart."""
    hf = transformers.AutoTokenizer.from_pretrained(tiny("llama"))
    hf.add_special_tokens({"additional_special_tokens": ["<|channel>", "<channel|>"]})
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    text = "<|channel>thought\nHmm.<channel|>Hi"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == "thought\nHmm.Hi"  # special tokens left out
    tokenizer.keep(THOUGHT)
    assert tokenizer.decode(ids) == text
    assert Reading(None, THOUGHT).reply(tokenizer.decode(ids)) == ("Hmm.", "Hi", [])


@pytest.mark.parametrize(
    "path, options, kwargs, opened",
    [
        (QWEN3, ChatOptions(), {}, False),
        (QWEN3, ChatOptions({"enable_thinking": False}), {"enable_thinking": False}, False),
        (QWEN3, ChatOptions(reasoning_budget=0), {"enable_thinking": False}, False),  # the template's switch
        (R1, ChatOptions(), {}, True),
        (GEMMA4, ChatOptions(), {}, False),  # off by default: the generation prompt closes an empty channel
        (GEMMA4, ChatOptions({"enable_thinking": True}), {"enable_thinking": True}, False),
        (GEMMA4, ChatOptions(reasoning_budget=0), {"enable_thinking": False}, False),
    ],
)
def test_prompts_render_as_transformers_with_the_templates_switch(tiny, path, options, kwargs, opened):
    """`chat_template_kwargs` and a budget of 0 reach the template as transformers'
    apply_chat_template(**kwargs) passes them; an earlier turn's reasoning is the template's to drop."""
    source = path.read_text()
    hf = transformers.AutoTokenizer.from_pretrained(tiny("llama"))
    markers = think_markers(source)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": f"{markers[0]}\nGreet back.\n{markers[1]}\n\nHello."},
        {"role": "user", "content": "Weather?"},
    ]
    expected = hf.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True, **kwargs
    )
    text, reading = ChatTemplate(source, Tokenizer(tiny("llama")).special_tokens).prompt(messages, options)
    assert text == expected and "Greet back" not in text
    assert reading == Reading(None, markers, opened)


def test_a_budget_of_0_closes_a_block_the_template_opens():
    """DeepSeek-R1's template has no switch: the block it opens is closed empty, and the reply is the answer."""
    text, reading = ChatTemplate(R1.read_text(), {}).prompt(
        [{"role": "user", "content": "Hi"}], ChatOptions(reasoning_budget=0)
    )
    assert text.endswith("<｜Assistant｜><think>\n</think>\n\n") and not reading.opened
    assert reading.reply("Hello.") == (None, "Hello.", [])
    plain, _ = ChatTemplate((TEMPLATES / "qwen2.5.jinja").read_text(), {}).prompt(
        [{"role": "user", "content": "Hi"}], ChatOptions(reasoning_budget=0)
    )
    assert "<think>" not in plain  # a model that does not think: nothing to turn off


def test_requests_say_the_templates_variables_and_the_reading(tiny):
    from jaxinfer.api import Parser
    from jaxinfer.loading import load_model

    model = load_model(tiny("llama"), chat_template=QWEN3.read_text())
    parser = Parser(model, 4096)
    messages = [{"role": "user", "content": "Hi"}]
    thinking = parser.parse(0, {"messages": messages, "tools": [WEATHER]})
    assert thinking.reading == Reading("hermes", THINK)
    off = parser.parse(1, {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert model.tokenizer.decode(off.prompt_ids).endswith("<think>\n\n</think>\n\n")
    assert parser.parse(2, {"messages": messages, "reasoning_format": "none"}).reading == Reading()
    # OpenAI's clients send an effort to any model: a template that takes none leaves it
    plain = parser.parse(3, {"messages": messages}).prompt_ids
    assert parser.parse(4, {"messages": messages, "reasoning_effort": "high"}).prompt_ids == plain
    for item, said in [
        ({"messages": messages, "chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"messages": messages, "chat_template_kwargs": ["x"]}, "must be an object"),
        ({"messages": messages, "reasoning_format": "deepseek"}, "reasoning_format must be one of auto, none"),
        ({"prompt": "Hi", "chat_template_kwargs": {}}, '"chat_template_kwargs" goes with "messages"'),
    ]:
        with pytest.raises(JaxinferError, match=said):
            parser.parse(9, item)


def test_a_budget_closes_the_thinking_block_after_n_tokens():
    """--reasoning-budget N (llama.cpp's): once a thinking block holds N tokens its closer is written,
    then the model goes on. Markers taken from what the bundled model writes greedily, so the block
    opens in the loop as well as in the prompt: the tokens before the closer are the free run's and
    the closer follows the N-th, each row's its own in one batch. (The message before the closer:
    the CLI's test; a guarded row beside a speculating one: test_penalties' min_tokens.)"""
    from jaxinfer.loading import load_model
    from jaxinfer.replies import Thinking
    from jaxinfer.sampling import Sampling
    from jaxinfer.scheduler import Request, Scheduler

    model = load_model()
    ids = model.tokenizer.encode("def fibonacci(n):")
    closer = list(model.tokenizer.encode(" END", add_special_tokens=False))
    scheduler = Scheduler(model, 2, 256)

    def run(**asked: dict) -> dict[str, list[int]]:
        """Each named request's 40 greedy tokens, the requests run together."""
        made: dict[str, list[int]] = {name: [] for name in asked}
        requests = [
            Request(name, ids, Sampling(), 40, 0, ignore_eos=True, **settings) for name, settings in asked.items()
        ]
        for request in requests:
            request.on_tokens = lambda tokens, logprobs, reason, into=made[request.id]: into.extend(tokens)
        scheduler.run(requests, None)
        return made

    free = run(free={})["free"]
    assert not set(closer) & set(free[:16])  # the closer is the budget's, not the model's own
    assert run(floored={"min_tokens": 8}, free={}) == {"floored": free, "free": free}  # guards, no markers yet
    opener = tuple(free[3:5])
    made = run(  # the markers join the guards: one opener and closer for every row
        in_loop={"thinking": Thinking(6, False, opener, tuple(closer))},
        by_prompt={"thinking": Thinking(4, True, opener, tuple(closer))},
    )
    assert made["in_loop"][:13] == free[:11] + closer and made["by_prompt"][:6] == free[:4] + closer


def test_a_requests_budget_bounds_its_block_with_the_templates_markers():
    """`thinking_budget_tokens` (llama-server's field; Anthropic's `thinking.budget_tokens`) and
    `--reasoning-budget N` give the template's markers as tokens; harmony's format has its own bound."""
    from jaxinfer import anthropic
    from jaxinfer.api import Parser
    from jaxinfer.loading import load_model
    from jaxinfer.replies import Thinking, bounded

    model = load_model(chat_template=R1.read_text())
    encode = lambda text: tuple(model.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    messages = [{"role": "user", "content": "Hi"}]
    asked = Parser(model, 256).parse(0, {"messages": messages, "thinking_budget_tokens": 5})
    assert asked.thinking == Thinking(5, True, encode("<think>"), encode("</think>")) and not asked.speculate
    item = anthropic.to_item(
        {"messages": messages, "max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 5}}
    )
    assert Parser(model, 256).parse(0, item).thinking == asked.thinking
    for budget in (-1, 0):  # unbounded, or the template's switch
        assert Parser(model, 256).parse(0, {"messages": messages, "thinking_budget_tokens": budget}).thinking is None
    with pytest.raises(JaxinferError, match="reasoning_budget N is not offered in harmony's format"):
        bounded(5, "<|start|>{{ m }}<|channel|>final<|message|>", False, model.tokenizer)


SAY_HELLO = ("run", "Say hello.", "--system", "Be brief.", "--temp", 0, "--json")  # a chat turn through run


@pytest.mark.slow
def test_run_closes_the_block_at_the_budget():
    from jaxinfer.loading import load_model

    budget = ("--reasoning-budget", 5, "--reasoning-budget-message", " Enough.", "--ignore-eos")
    ran = jaxinfer(*SAY_HELLO, "--chat-template-file", R1, *budget, "-n", 24)
    assert ran.returncode == 0, ran.stderr
    result, tokenizer = json.loads(ran.stdout), load_model().tokenizer
    forced = [t for text in (" Enough.", "</think>") for t in tokenizer.encode(text, add_special_tokens=False)]
    assert result["token_ids"][5 : 5 + len(forced)] == forced  # R1's prompt opens the block: 5 tokens in it
    assert result["reasoning"] == tokenizer.decode(result["token_ids"][:5]).strip() + " Enough."


# a reply that thinks and then answers, whatever the weights: the server's constraint writes its shape
SHAPE = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."


@pytest.mark.slow
def test_run_json_gives_the_reasoning_apart():
    ran = jaxinfer(*SAY_HELLO, "--chat-template-file", QWEN3, "--regex", SHAPE, "-n", 64)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["text"] == f"<think>\n{result['reasoning']}\n</think>\n\n{result['content']}"
    assert result["reasoning"] and result["tool_calls"] == []


@pytest.mark.slow
def test_chat_folds_the_reasoning_and_keeps_only_the_answer():
    """In the terminal the reasoning shows while it comes and folds to one line when the answer
    starts; the conversation keeps the answer (the template drops earlier reasoning anyway)."""
    child = pexpect.spawn(
        "jaxinfer",
        ["chat", "--chat-template-file", str(QWEN3), "--regex", SHAPE, "--temp", "0", "-n", "64"],
        encoding="utf-8",
        timeout=WAIT_S,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "200"},
    )
    child.expect_exact(">>> ")
    child.sendline("Say hello.")
    child.expect(r"▸ thought for [\d.]+ s, \d+ words")
    child.expect(FOOTER)
    answer = child.before
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect_exact("2 messages")
    child.expect_exact(">>> ")  # Ctrl-D before the prompt reads is lost
    child.sendeof()
    child.expect(pexpect.EOF)
    assert child.wait() == 0 and "Traceback" not in child.before
    assert "<think>" not in answer and "</think>" not in answer
    assert re.search(r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\.", answer), answer
