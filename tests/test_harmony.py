"""gpt-oss's harmony format: conversations rendered by its own chat template as transformers renders
them, replies read into reasoning, answer and tool calls (as llama.cpp's gpt-oss parser and OpenAI's
harmony guide read them), shown as they stream, and the tokenizer keeping the markers that say which
is which."""

import json

import pytest
import transformers
from test_tools import TEMPLATES, WEATHER
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from jaxinfer import harmony
from jaxinfer.api import openai_body, openai_chunk
from jaxinfer.chat_template import ChatTemplate
from jaxinfer.errors import JaxinferError
from jaxinfer.replies import Reading
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.tools import format_of, template_messages

HARMONY = Reading("harmony")

TEMPLATE = (TEMPLATES / "gpt-oss.jinja").read_text()
THINK = "<|channel|>analysis<|message|>The user asks the weather.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 18 °C in Paris.<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)

REPLIES = [
    (THINK + ANSWER, "The user asks the weather.", "It is 18 °C in Paris.", []),
    (THINK + CALL, "The user asks the weather.", None, [("get_weather", {"city": "Paris"})]),
    # the recipient in the role's header (the guide allows both places), no constrain
    (
        THINK + '<|start|>assistant to=functions.get_weather<|channel|>commentary<|message|>{"city": "Köln"}<|call|>',
        "The user asks the weather.",
        None,
        [("get_weather", {"city": "Köln"})],
    ),
    # a preamble on commentary before the call: content the user sees
    (
        "<|channel|>commentary<|message|>Let me look.<|end|>" + CALL,
        None,
        "Let me look.",
        [("get_weather", {"city": "Paris"})],
    ),
    # as generated: the reply's end (<|call|>, <|return|>) is an EOS, not in the text
    (THINK + CALL.removesuffix("<|call|>"), "The user asks the weather.", None, [("get_weather", {"city": "Paris"})]),
    (THINK + ANSWER.removesuffix("<|return|>"), "The user asks the weather.", "It is 18 °C in Paris.", []),
    ("Hello without a header.", None, "Hello without a header.", []),  # a model that skipped it
    # a built-in tool's call (browser, python: not offered here) stays as written, in the content
    (
        THINK + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>' + ANSWER,
        'The user asks the weather.\n\n{"q": "x"}',
        "It is 18 °C in Paris.",
        [],
    ),
    (
        THINK + '<|start|>assistant<|channel|>commentary to=browser.search<|message|>{"q": "x"}<|call|>' + ANSWER,
        "The user asks the weather.",
        '{"q": "x"}\n\nIt is 18 °C in Paris.',
        [],
    ),
    (THINK + "<|start|>assistant<|channel|>final<|message|>cut short", "The user asks the weather.", "cut short", []),
    ("<|channel|>analysis<|message|>only thinking, cut", "only thinking, cut", None, []),
    # a call whose arguments are not JSON: kept as written, in the content
    (
        THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>Paris?<|call|>",
        "The user asks the weather.",
        "Paris?",
        [],
    ),
]


@pytest.mark.parametrize("text, reasoning, content, calls", REPLIES)
def test_a_reply_reads_into_reasoning_answer_and_calls(text, reasoning, content, calls):
    got_reasoning, got_content, got_calls = HARMONY.reply(text)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("text", [r[0] for r in REPLIES])
def test_what_streams_only_grows_and_ends_as_the_reply(text):
    """Cut after every character (a token may end mid-marker): the reasoning and answer shown so far
    only grow, never show a marker or a header, and end as the whole reply reads (less a call whose
    arguments did not parse, which the end adds)."""
    shown = ("", "")
    for n in range(len(text) + 1):
        now = HARMONY.visible(text[:n])
        assert now[0].startswith(shown[0]) and now[1].startswith(shown[1]), text[:n]
        assert not any("<|" in part or "|>" in part for part in now), text[:n]
        shown = now
    reasoning, content, calls = HARMONY.reply(text)
    assert shown[0] == (reasoning or "")
    assert (content or "").startswith(shown[1])


def test_the_template_is_harmony_and_renders_as_transformers(tiny):
    """gpt-oss's own template (its hub repository's, as llama.cpp keeps it): tools in its TypeScript
    namespace, an earlier call and its answer, the reasoning effort asked for; transformers renders
    it the same."""
    assert format_of(TEMPLATE) == "harmony" and harmony.is_harmony(TEMPLATE)
    assert not harmony.is_harmony((TEMPLATES / "qwen2.5.jinja").read_text())
    path = tiny("llama")
    conversation = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 °C"},
    ]
    as_objects = json.loads(json.dumps(conversation))
    as_objects[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf = transformers.AutoTokenizer.from_pretrained(path)
    ours = ChatTemplate(TEMPLATE, Tokenizer(path).special_tokens)
    for effort in (None, "high"):
        extra = {} if effort is None else {"reasoning_effort": effort}
        expected = hf.apply_chat_template(
            as_objects, tools=[WEATHER], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True, **extra
        )
        rendered = ours.render(template_messages(conversation), tools=[WEATHER], **extra)
        assert rendered == expected
        assert f"Reasoning: {effort or 'medium'}" in rendered
    assert "type get_weather = " in rendered and rendered.endswith("<|start|>assistant")
    assert ours.reasoning("low") == {"reasoning_effort": "low"} and ours.reasoning(None) == {}
    qwen = ChatTemplate((TEMPLATES / "qwen2.5.jinja").read_text(), {})
    for template, effort, said in ((ours, "max", "must be"), (qwen, "low", "takes no reasoning_effort")):
        with pytest.raises(JaxinferError, match=said):
            template.reasoning(effort)


def test_the_tokenizer_keeps_the_markers_decoding_would_drop(tmp_path):
    """Special tokens are left out of decoded text; a harmony model's markers are kept (`keep`),
    or its reply would read "analysisThe user…assistantfinalIt is…"."""
    words = ["analysis", "final", "assistant", "The", "user", "asks", "It", "is", "warm", "[UNK]"]
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(list(harmony.MARKERS) + ["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tokenizer = Tokenizer(tmp_path)
    text = "<|channel|>analysis<|message|>The user asks<|end|><|start|>assistant<|channel|>final<|message|>It is warm"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "<|" not in tokenizer.decode(ids)
    tokenizer.keep(harmony.MARKERS)
    decoded = tokenizer.decode(ids + [tokenizer.token_id("<|endoftext|>")])  # other specials still left out
    assert decoded.replace(" ", "") == text.replace(" ", "")
    assert HARMONY.reply(decoded)[:2] == ("The user asks", "It is warm")
    assert harmony.stop_ids(tokenizer) == (tokenizer.token_id("<|return|>"), tokenizer.token_id("<|call|>"))


def test_the_api_answers_with_the_reasoning_apart():
    """OpenAI's chat message as vLLM and llama.cpp give a reasoning model's: `reasoning_content`
    beside `content`, the calls in `tool_calls`; a stream's chunk carries new reasoning the same way."""
    record = {"text": THINK + CALL, "finish_reason": "stop", "prompt_tokens": 5, "generated_tokens": 20, "seed": 0}
    body = openai_body([record | {"timings": {}}], "/v1/chat/completions", "gpt-oss", HARMONY)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user asks the weather."
    assert choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    plain = openai_body([record | {"timings": {}, "text": "Hi"}], "/v1/chat/completions", "m", None)
    assert "reasoning_content" not in plain["choices"][0]["message"]
    chunk = openai_chunk("/v1/chat/completions", "id", 0, "m", 0, "", reasoning="thinking")
    assert chunk["choices"][0]["delta"] == {"reasoning_content": "thinking"}


def test_a_request_to_a_harmony_model_is_read_as_one(tiny):
    """Every chat reply of such a model is read (tools offered or not); `reasoning_effort` goes to
    the template; what the format cannot do, or a value it does not know, is one clear refusal."""
    from jaxinfer.api import Parser
    from jaxinfer.loading import load_model

    model = load_model(tiny("llama"))
    parser = Parser(model, 512)
    parser._template = ChatTemplate(TEMPLATE, model.tokenizer.special_tokens)
    messages = [{"role": "user", "content": "Hi"}]
    assert parser.parse(0, {"messages": messages}).reading == HARMONY
    low = parser.parse(1, {"messages": messages, "reasoning_effort": "low", "tools": [WEATHER]})
    assert low.reading == HARMONY and "Reasoning: low" in model.tokenizer.decode(low.prompt_ids)
    refused = [
        ({"messages": messages, "reasoning_effort": "max"}, "reasoning_effort must be"),
        ({"messages": messages, "tools": [WEATHER], "tool_choice": "required"}, "a forced tool call"),
        ({"prompt": "Hi", "reasoning_effort": "low"}, '"reasoning_effort" goes with "messages"'),
    ]
    for item, said in refused:
        with pytest.raises(JaxinferError, match=said):
            parser.parse(2, item)


def test_a_batch_line_of_our_shape_gets_the_reply_read_as_run_json_does(tiny):
    """A harmony model's answer in a batch record of our shape: the text as made, and beside it the
    reasoning, the content and the calls (`run --json`'s fields); OpenAI's lines had them already."""
    import io

    from jaxinfer.jobs import Job
    from jaxinfer.loading import load_model

    model = load_model(tiny("llama"))
    out = io.StringIO()
    job = Job(model, 512, 8, out)
    job.parser._template = ChatTemplate(TEMPLATE, model.tokenizer.special_tokens)
    lines = [
        json.dumps({"id": "h", "messages": [{"role": "user", "content": "Weather?"}]}),
        '{"id": "p", "prompt": "x"}',
    ]
    assert [r.reading for r in job.requests(lines)] == [HARMONY, None]
    made = {"text": THINK + CALL, "finish_reason": "stop", "prompt_tokens": 5, "generated_tokens": 20, "seed": 0}
    job.write({"id": "h", **made})
    job.write({"id": "p", **made})
    chat, plain = map(json.loads, out.getvalue().splitlines())
    assert chat["text"] == THINK + CALL and chat["reasoning"] == "The user asks the weather."
    assert chat["content"] is None and json.loads(chat["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert "reasoning" not in plain  # a prompt: text only
