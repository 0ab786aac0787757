"""Tool calling: tools and earlier calls rendered as transformers renders them, and calls parsed back
out of the text in each format (the server's end-to-end test is in test_server.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import transformers

from jaxinfer.chat_template import ChatTemplate
from jaxinfer.constrain import Constraint
from jaxinfer.errors import JaxinferError
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tools import check_tools, forced_grammar, format_of, split, streamable, template_messages

TEMPLATES = Path(__file__).parent / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "15 °C"},
]


def test_tools_and_calls_render_as_transformers(tiny):
    path = tiny("llama")
    source = (TEMPLATES / "qwen2.5.jinja").read_text()
    hf = transformers.AutoTokenizer.from_pretrained(path)
    # transformers' templates take each call's arguments as an object; OpenAI sends their JSON text
    as_objects = json.loads(json.dumps(CONVERSATION))
    for call in as_objects[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = hf.apply_chat_template(
        as_objects, tools=[WEATHER], chat_template=source, tokenize=False, add_generation_prompt=True
    )
    ours = ChatTemplate(source, Tokenizer(path).special_tokens)
    rendered = ours.render(template_messages(CONVERSATION), tools=[WEATHER])
    assert rendered == expected
    assert '"name": "get_weather"' in rendered and "<tool_response>\n18 °C" in rendered


def test_which_templates_take_tools():
    assert format_of((TEMPLATES / "qwen2.5.jinja").read_text()) == "hermes"
    for name in ("llama3", "mistral", "gemma", "phi3"):  # these versions of theirs offer no tools
        assert format_of((TEMPLATES / f"{name}.jinja").read_text()) is None
    assert format_of(None) is None
    assert format_of("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert format_of('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') == "llama3"


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "Let me look.",
            [("f", {"a": 1})],
        ),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"x": "é"}}</tool_call>',
            None,
            [("f", {}), ("g", {"x": "é"})],
        ),
        ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
        ("hermes", "No call here.", "No call here.", []),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
        ("mistral", ' [{"name": "f", "arguments": {}}]', None, [("f", {})]),
        ("mistral", "[1, 2] are numbers", "[1, 2] are numbers", []),
        ("llama3", '{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
        ("llama3", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ],
)
def test_calls_are_split_from_the_text(fmt, text, content, calls):
    got_content, got = split(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert len({c["id"] for c in got}) == len(got)


def test_what_may_stream_before_a_call():
    assert streamable("Hello <tool", "hermes") == len("Hello ")  # a marker may be starting
    assert streamable("Hello <tool_call>{", "hermes") == len("Hello ")
    assert streamable("a < b", "hermes") == len("a < b")
    assert streamable(" {", "llama3") == 0 and streamable("<|py", "llama3") == 0
    assert streamable("Sure: {", "llama3") == len("Sure: {")
    assert streamable("[TOOL", "mistral") == 0 and streamable("Hi", "mistral") == 2


def test_tool_fields_are_checked():
    other = {"type": "function", "function": {"name": "other"}}
    assert check_tools(None, None) == (None, None) and check_tools([], "auto") == (None, None)
    assert check_tools([WEATHER], "none") == (None, None)  # offered nothing: answered as text
    assert check_tools([WEATHER], "auto") == ([WEATHER], None)
    assert check_tools([WEATHER, other], "required") == ([WEATHER, other], [WEATHER, other])
    named = {"type": "function", "function": {"name": "other"}}
    assert check_tools([WEATHER, other], named) == ([WEATHER, other], [other])
    for tools, choice, words in [
        ([{"type": "function"}], None, '"tools" must be'),
        ({"get_weather": {}}, None, '"tools" must be'),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "one of the tools"),
        ([WEATHER], "always", "one of the tools"),
        (None, "required", "gives none"),
    ]:
        with pytest.raises(JaxinferError, match=words):
            check_tools(tools, choice)
    with pytest.raises(JaxinferError, match="arguments"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3"])
def test_a_forced_call_grammar_takes_the_calls_split_reads(tiny, fmt):
    """Each format's grammar accepts a call as the model writes it (which `split` reads back) and
    refuses arguments its function's parameters do not allow."""
    from jaxinfer.matchers import Matchers

    tokenizer = Tokenizer(tiny("llama"))
    matchers = Matchers(tokenizer, tokenizer.vocab_size, 1, ())
    tools = [WEATHER, {"type": "function", "function": {"name": "noop"}}]
    call = {"name": "get_weather", ("parameters" if fmt == "llama3" else "arguments"): {"city": "Paris"}}
    text = json.dumps(call, ensure_ascii=False)
    text = {"hermes": f"<tool_call>\n{text}\n</tool_call>", "mistral": f"[{text}]", "llama3": text}[fmt]
    for candidate, valid in [(text, True), (text.replace('"Paris"', "7"), False)]:
        matchers.start(0, Constraint("grammar", forced_grammar(tools, fmt)))
        matchers.advance(np.array([tokenizer.encode(candidate, add_special_tokens=False)]))
        assert matchers.complete(0) == valid, (fmt, candidate)
    assert [c["function"]["name"] for c in split(text, fmt)[1]] == ["get_weather"]
    Constraint("grammar", forced_grammar(tools, fmt)).check()
