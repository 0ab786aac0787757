"""What a request body may say (`jaxinfer.api`): the fields clients send as null, roles, stop
lists. The parser is what batch lines and served bodies both go through."""

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
