"""What a request body may say (`jaxinfer.api`): the fields clients send as null, roles, stop
lists. The parser is what batch lines and served bodies both go through."""

from dataclasses import replace

import pytest
from test_chat_template import TEMPLATES

from jaxinfer.api import Parser, from_openai
from jaxinfer.chat_template import ChatTemplate
from jaxinfer.errors import JaxinferError
from jaxinfer.text import MAX_STOPS


@pytest.fixture(scope="module")
def parser(tiny):
    from jaxinfer.loading import load_model

    model = load_model(tiny("llama"))
    parser = Parser(model, 512)
    parser._template = ChatTemplate(TEMPLATES["llama3"], model.tokenizer.special_tokens)
    return parser


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions"])
def test_null_is_not_given(parser, url):
    """The official client with an optional setting forwarded as None: OpenAI reads it as unset."""
    said = {"prompt": "Hi"} if url == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    nulls = ["max_tokens", "temperature", "seed", "top_p", "presence_penalty", "frequency_penalty", "stop"]
    nulls += ["logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice", "n", "user"]
    plain = parser.parse(0, from_openai(url, said | {"seed": 1}))
    nulled = parser.parse(0, from_openai(url, said | dict.fromkeys(nulls) | {"seed": 1}))
    assert nulled == plain
    assert parser.parse(0, from_openai(url, said | {"seed": None})).seed >= 0  # one drawn, as unset
    assert parser.parse(0, said | {"seed": 1, "max_tokens": None}) == plain  # our own shape (batch lines) too


def test_developer_is_system_and_an_unknown_role_is_refused(parser):
    user = {"role": "user", "content": "Hi"}
    as_system = parser.parse(0, {"messages": [{"role": "system", "content": "Be brief."}, user], "seed": 1})
    as_developer = parser.parse(0, {"messages": [{"role": "developer", "content": "Be brief."}, user], "seed": 1})
    assert as_developer.prompt_ids == as_system.prompt_ids and len(as_system.prompt_ids) > len(
        parser.parse(0, {"messages": [user]}).prompt_ids
    )
    with pytest.raises(JaxinferError, match="no 'narrator' role"):
        parser.parse(0, {"messages": [{"role": "narrator", "content": "Once"}, user]})


def test_the_stop_list_is_bounded(parser):
    parser.parse(0, {"prompt": "Hi", "stop": [f"s{k}" for k in range(MAX_STOPS)]})
    with pytest.raises(JaxinferError, match=f"at most {MAX_STOPS}"):
        parser.parse(0, {"prompt": "Hi", "stop": [f"s{k}" for k in range(MAX_STOPS + 1)]})
    with pytest.raises(JaxinferError, match="over 256 characters"):
        parser.parse(0, {"prompt": "Hi", "stop": ["x" * 257]})


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


def test_the_fields_clients_send_are_honoured_ignored_or_refused(parser):
    """docs/server.md's table: each field other clients send is read, accepted as changing nothing,
    or refused in one line; any other unknown field stays a 400."""
    from test_tools import TEMPLATES as TEMPLATE_FILES
    from test_tools import WEATHER

    plain = parser.parse(0, from_openai(CHAT, {"messages": HI, "seed": 1}))
    harmless = {
        "verbosity": "low",
        "prediction": {"type": "content", "content": "Hello"},
        "modalities": ["text"],
        "skip_special_tokens": True,
        "reasoning_effort": "high",  # this template takes none: OpenAI's clients send it to any model
        "chat_template_kwargs": {"unread": 1},
    }
    assert parser.parse(0, from_openai(CHAT, {"messages": HI, "seed": 1} | harmless)) == plain
    # vLLM's min_tokens is read (the row then drafts nothing); a budget for a model that does not think
    # changes nothing
    floor = parser.parse(0, from_openai(CHAT, {"messages": HI, "seed": 1, "min_tokens": 8}))
    assert floor.min_tokens == 8 and floor == replace(plain, min_tokens=8, speculate=False)
    assert parser.parse(0, from_openai(CHAT, {"messages": HI, "seed": 1, "thinking_budget_tokens": 16})) == plain
    for field, value, said in [
        ("web_search_options", {}, "searching the web is not offered"),
        ("min_tokens", -1, "must be a whole number ≥ 0"),
        ("min_tokens", 10**6, r'"min_tokens" \(1000000\) must not pass "max_tokens"'),
        ("thinking_budget_tokens", -2, "must be a whole number ≥ -1"),
        ("modalities", ["text", "audio"], r'only \["text"\]'),
        ("skip_special_tokens", False, "only true"),
        ("guided_decoding_backend", "x", "unknown field"),
    ]:
        with pytest.raises(JaxinferError, match=said):
            parser.parse(0, from_openai(CHAT, {"messages": HI, field: value}))
    # the deprecated names of tools and tool_choice, to a template that offers tools
    parser = Parser(parser.model, 4096)
    parser._template = ChatTemplate(
        (TEMPLATE_FILES / "qwen2.5.jinja").read_text(), parser.model.tokenizer.special_tokens
    )
    tools = parser.parse(0, from_openai(CHAT, {"messages": HI, "tools": [WEATHER], "seed": 1}))
    functions = parser.parse(0, from_openai(CHAT, {"messages": HI, "functions": [WEATHER["function"]], "seed": 1}))
    assert functions == tools
    forced = {"messages": HI, "functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}}
    chosen = {"type": "function", "function": {"name": "get_weather"}}
    assert (
        parser.parse(0, from_openai(CHAT, forced)).constraint
        == parser.parse(0, from_openai(CHAT, {"messages": HI, "tools": [WEATHER], "tool_choice": chosen})).constraint
    )
    with pytest.raises(JaxinferError, match='"functions" is the older name of "tools"'):
        from_openai(CHAT, {"messages": HI, "functions": [], "tools": []})


def test_a_reply_begun_is_continued_and_the_generation_prompt_may_be_left_out(parser):
    """transformers' `continue_final_message` and `add_generation_prompt`, as vLLM takes them."""
    decode = parser.model.tokenizer.decode
    begun = HI + [{"role": "assistant", "content": "Hello, I am"}]
    continued = decode(parser.parse(0, {"messages": begun, "continue_final_message": True}).prompt_ids)
    whole = decode(parser.parse(0, {"messages": HI}).prompt_ids)
    assert continued.endswith("Hello, I am") and continued.startswith(whole)
    bare = decode(parser.parse(0, {"messages": HI, "add_generation_prompt": False}).prompt_ids)
    assert whole.startswith(bare) and len(bare) < len(whole)
    with pytest.raises(JaxinferError, match="continues the last message: an assistant's"):
        parser.parse(0, {"messages": HI, "continue_final_message": True})
    with pytest.raises(JaxinferError, match='"add_generation_prompt" must be true or false'):
        parser.parse(0, {"messages": HI, "add_generation_prompt": "yes"})
