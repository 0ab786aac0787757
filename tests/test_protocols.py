"""The protocols beside OpenAI's that agents and editors speak, each a thin adapter over the one
parser and scheduler: Anthropic's Messages (`/v1/messages`, driven by the official `anthropic`
client, as Claude Code speaks it) and llama.cpp's utility endpoints; and a thinking model's
reasoning apart through OpenAI's chat endpoint. Greedy, each gives the tokens
`/v1/chat/completions` gives for the same conversation; streamed equals whole; reasoning never
leaks into the text."""

import json

import anthropic
import httpx
import openai
import pytest
from test_reasoning import QWEN3, SHAPE
from test_server import WAIT_S, Served

pytestmark = pytest.mark.slow

KEY = "sk-protocols"
GREEDY = {"extra_body": {"temperature": 0}}  # today's client sends no sampling fields of its own
ASK = {"model": "any", "max_tokens": 24, "system": "Be brief.", "messages": [{"role": "user", "content": "Say hello."}]}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def served():
    server = Served("-b", "2", "-c", "512", "--api-key", KEY, "--chat-template-file", QWEN3)
    yield server
    server.stop()
    assert "Traceback" not in "".join(server.stderr)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, timeout=WAIT_S, max_retries=0)


@pytest.fixture(scope="module")
def chat(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, timeout=WAIT_S, max_retries=0)


def texts(message) -> list[tuple[str, str]]:
    return [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None)) for b in message.content]


def test_messages_give_chat_completions_tokens_streamed_as_whole(claude, chat):
    said = claude.messages.create(**ASK, **GREEDY)
    openai_said = chat.chat.completions.create(
        model="any",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
    )
    assert texts(said) == [("text", openai_said.choices[0].message.content)]
    assert (said.stop_reason, said.usage.output_tokens) == ("max_tokens", 24)
    assert said.usage.input_tokens == openai_said.usage.prompt_tokens
    assert claude.messages.count_tokens(model="any", system="Be brief.", messages=ASK["messages"]).input_tokens == (
        said.usage.input_tokens
    )
    with claude.messages.stream(**ASK, **GREEDY) as stream:
        streamed = stream.get_final_message()
    assert texts(streamed) == texts(said) and streamed.stop_reason == said.stop_reason
    # a stop sequence the answer meets: named as the one that stopped it, and not in the text
    stop = said.content[0].text.strip()[1:4]
    stopped = claude.messages.create(**ASK | {"stop_sequences": ["unmet stop", stop]}, **GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert said.content[0].text.startswith(stopped.content[0].text) and stop not in stopped.content[0].text


def test_a_forced_tool_is_a_tool_use_block_as_openai_s_call(claude, chat):
    used = claude.messages.create(
        model="any",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    function = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    called = chat.chat.completions.create(
        model="any",
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"type": "function", "function": function}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = called.choices[0].message.tool_calls[0]
    assert used.stop_reason == "tool_use" and used.content[-1].type == "tool_use"
    assert (used.content[-1].name, used.content[-1].input) == ("get_weather", json.loads(call.function.arguments))
    with claude.messages.stream(
        model="any",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[-1].input == used.content[-1].input and streamed.stop_reason == "tool_use"
    # the call and its result in the next turn: rendered as the template renders OpenAI's
    answered = claude.messages.create(
        model="any",
        max_tokens=8,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [used.content[-1].model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": used.content[-1].id, "content": "18 °C"}],
            },
        ],
        **GREEDY,
    )
    assert answered.usage.input_tokens > used.usage.input_tokens


def test_a_reply_begun_in_thought_continues_as_a_thinking_block(claude):
    """Anthropic's prefill: the last assistant turn is continued; begun inside the template's
    thinking block, what follows is reasoning (a thinking block), never text."""
    ask = {"model": "any", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    ask["messages"] = ask["messages"] + [{"role": "assistant", "content": "<think>\nThe user"}]
    said = claude.messages.create(**ask, **GREEDY)
    assert [b.type for b in said.content] == ["thinking"] and said.stop_reason == "max_tokens"
    with claude.messages.stream(**ask, **GREEDY) as stream:
        assert texts(stream.get_final_message()) == texts(said)


def test_structured_output_and_refusals_in_anthropic_s_shape(served, claude):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    shaped = claude.messages.create(
        model="any",
        max_tokens=32,
        messages=[{"role": "user", "content": "JSON"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert isinstance(json.loads(shaped.content[0].text)["a"], int)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="'image' block is not taken here"):
        claude.messages.create(model="any", max_tokens=8, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(**ASK)
    bare = httpx.post(served.url + "/v1/messages", headers={"x-api-key": KEY}, json={"messages": []}, timeout=WAIT_S)
    assert bare.status_code == 400 and bare.json()["error"]["type"] == "invalid_request_error"
    assert '"max_tokens" are required' in bare.json()["error"]["message"]


def test_llama_server_s_utility_endpoints(served, chat):
    """/tokenize, /detokenize, /apply-template and /props, as llama-server answers them: the prompt
    /apply-template gives is the one the chat endpoint reads (its token count)."""

    def post(path, body):
        answer = httpx.post(served.url + path, headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=WAIT_S)
        assert answer.status_code == 200, answer.text
        return answer.json()

    ids = post("/tokenize", {"content": "def fibonacci(n):"})["tokens"]
    assert post("/detokenize", {"tokens": ids})["content"] == "def fibonacci(n):"
    pieces = post("/tokenize", {"content": "def fibonacci(n):", "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids and all(isinstance(p["piece"], (str, list)) for p in pieces)
    messages = [{"role": "user", "content": "Say hello."}]
    prompt = post("/apply-template", {"messages": messages})["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Say hello." in prompt
    off = post("/apply-template", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert off["prompt"] == prompt + "<think>\n\n</think>\n\n"
    asked = chat.chat.completions.create(model="any", max_tokens=1, messages=messages)
    assert asked.usage.prompt_tokens == len(post("/tokenize", {"content": prompt})["tokens"])
    props = httpx.get(served.url + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S).json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512
    assert "enable_thinking" in props["chat_template"]
    bad = httpx.post(served.url + "/detokenize", headers={"Authorization": f"Bearer {KEY}"}, json={"tokens": [-1]})
    assert bad.status_code == 400 and "not one of this model's" in bad.json()["error"]["message"]


def test_the_server_gives_the_reasoning_apart_streamed_as_whole(chat):
    asked = dict(
        model="any",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=64,
        temperature=0,
        extra_body={"guided_regex": SHAPE},
    )
    whole = chat.chat.completions.create(**asked).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in whole.content and "</think>" not in whole.content
    assert whole.content[0].isupper() and whole.content.endswith(".")
    deltas = [c.choices[0].delta for c in chat.chat.completions.create(**asked, stream=True) if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == whole.content
    left = chat.chat.completions.create(**asked | {"extra_body": {"guided_regex": SHAPE, "reasoning_format": "none"}})
    assert left.choices[0].message.content == f"<think>\n{reasoning}\n</think>\n\n{whole.content}"
    off = chat.chat.completions.create(**asked | {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert off.usage.prompt_tokens > chat.chat.completions.create(**asked).usage.prompt_tokens


def test_ollama_s_api_gives_the_same_tokens_streamed_as_whole(served, chat):
    """/api/chat and /api/generate through the official `ollama` client: the chat endpoint's tokens
    (raw generate: the completions endpoint's), streamed as whole; the model listed and shown with
    the capabilities Copilot reads; images refused in ollama's error shape."""
    import ollama

    client = ollama.Client(host=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT_S)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    greedy = {"temperature": 0, "num_predict": 24}
    said = client.chat(model="any", messages=messages, options=greedy, stream=False)
    openai_said = chat.chat.completions.create(model="any", max_tokens=24, temperature=0, messages=messages)
    assert said.message.content == openai_said.choices[0].message.content
    assert (said.done_reason, said.eval_count, said.prompt_eval_count) == (
        "length",
        24,
        openai_said.usage.prompt_tokens,
    )
    parts = list(client.chat(model="any", messages=messages, options=greedy, stream=True))
    assert "".join(p.message.content for p in parts) == said.message.content and parts[-1].done
    off = client.chat(model="any", messages=messages, options=greedy, think=False, stream=False)
    assert off.prompt_eval_count > said.prompt_eval_count  # the template's empty thinking block
    raw = client.generate(model="any", prompt="def fibonacci(n):", raw=True, options=greedy, stream=False)
    completed = chat.completions.create(model="any", prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    assert raw.response == completed.choices[0].text
    streamed = "".join(
        p.response
        for p in client.generate(model="any", prompt="def fibonacci(n):", raw=True, options=greedy, stream=True)
    )
    assert streamed == raw.response
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    shaped = client.chat(
        model="any", messages=[{"role": "user", "content": "JSON"}], format=schema, options=greedy, stream=False
    )
    assert isinstance(json.loads(shaped.message.content)["a"], int)
    (listed,) = client.list().models
    shown = client.show(listed.model)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities) and "enable_thinking" in shown.template
    assert client.ps().models[0].model == listed.model
    assert httpx.get(served.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]
    with pytest.raises(ollama.ResponseError, match="images are not taken here"):
        client.chat(model="any", messages=[{"role": "user", "content": "Hi", "images": ["AA=="]}], stream=False)


def test_openai_s_responses_api_gives_reasoning_message_and_calls(chat):
    """/v1/responses (stateless) through the official client: the reasoning as a reasoning item, the
    answer as the message, streamed (the SDK's own accumulator) as whole; a forced function call and
    its output in the next input; what needs stored state refused."""
    shaped = {"max_output_tokens": 64, "temperature": 0, "extra_body": {"guided_regex": SHAPE}}
    said = chat.responses.create(model="any", input="Say hello.", **shaped)
    assert [i.type for i in said.output] == ["reasoning", "message"] and said.status == "completed"
    asked = chat.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=64,
        temperature=0,
        extra_body={"guided_regex": SHAPE},
    )
    assert said.output_text == asked.choices[0].message.content
    assert said.output[0].content[0].text == asked.choices[0].message.model_extra["reasoning_content"]
    with chat.responses.stream(model="any", input="Say hello.", **shaped) as stream:
        streamed = stream.get_final_response()
    assert (
        streamed.output_text == said.output_text
        and streamed.output[0].content[0].text == said.output[0].content[0].text
    )
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}]
    forced = {"tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 64}
    called = chat.responses.create(model="any", input="Weather in Paris?", temperature=0, **forced)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    with chat.responses.stream(model="any", input="Weather in Paris?", temperature=0, **forced) as stream:
        assert stream.get_final_response().output[-1].arguments == call.arguments
    answered = chat.responses.create(
        model="any",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 °C"},
        ],
        tools=tools,
        max_output_tokens=4,
        temperature=0,
    )
    assert answered.usage.input_tokens > called.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="nothing is stored here"):
        chat.responses.create(model="any", input="Hi", previous_response_id="resp_0")
    with pytest.raises(openai.BadRequestError, match="built-in tools are not offered"):
        chat.responses.create(model="any", input="Hi", tools=[{"type": "web_search"}])
