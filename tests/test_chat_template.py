"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from pathlib import Path

import pytest
import transformers

from jaxinfer.chat_template import ChatTemplate, read_template
from jaxinfer.errors import JaxinferError
from jaxinfer.tokenizer import Tokenizer

TEMPLATES = {p.stem: p.read_text() for p in (Path(__file__).parent / "chat_templates").glob("*.jinja")}
CONVERSATIONS = {
    "one turn": [{"role": "user", "content": "Hello!"}],
    "system and turns": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "  What is the capital of France?  \n"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of 日本? 🙂"},
    ],
    "alternating": [
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "That is {{ not }} jinja."},
        {"role": "user", "content": "ok"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tiny):
    path = tiny("llama")
    return Tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_the_real_world_templates_are_there():
    # gemma: google/gemma-7b-it's (no system role, "model" turns); phi3: microsoft/Phi-3-mini-4k-instruct's;
    # gpt-oss: openai/gpt-oss-120b's (harmony, as llama.cpp keeps it: models/templates/openai-gpt-oss-120b.jinja)
    assert set(TEMPLATES) == {"llama3", "qwen2.5", "mistral", "gemma", "phi3", "gpt-oss"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(tokenizers, name, conversation, add_generation_prompt):
    ours, hf = tokenizers
    messages = CONVERSATIONS[conversation]
    try:
        expected = hf.apply_chat_template(
            messages, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # the template refuses this conversation (mistral: no system role)
        with pytest.raises(JaxinferError, match="chat template: .*" + str(e)[:30].replace("(", r"\(")):
            ChatTemplate(TEMPLATES[name], ours.special_tokens).render(messages, add_generation_prompt)
        return
    assert ChatTemplate(TEMPLATES[name], ours.special_tokens).render(messages, add_generation_prompt) == expected


def test_template_sources_and_the_fallback(tmp_path, tokenizers):
    assert read_template(tmp_path, {}) is None
    assert read_template(tmp_path, {"chat_template": "A"}) == "A"
    assert (
        read_template(
            tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
        == "D"
    )
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_template(tmp_path, {"chat_template": "A"}) == "J"  # transformers 5 writes this file

    fallback = ChatTemplate(None, tokenizers[0].special_tokens)
    assert fallback.is_fallback and fallback.stop == ("\nUser:",)
    text = fallback.render(CONVERSATIONS["system and turns"])
    assert text == (
        "<s>You answer in one short sentence.\n\nUser:   What is the capital of France?  \n\n"
        "Assistant: Paris.\nUser: And of 日本? 🙂\nAssistant:"
    )


def test_a_broken_template_is_a_one_line_error(tokenizers):
    with pytest.raises(JaxinferError, match="does not parse"):
        ChatTemplate("{% for %}", tokenizers[0].special_tokens)
