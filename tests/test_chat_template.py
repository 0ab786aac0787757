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


@pytest.mark.parametrize(
    "source, words",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran over"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}", "ran over|wrote"),
        ("{{ 'x' * 10**9 }}", "over 16,777,216"),
        ("{{ ([0] * 10**9) | length }}", "over 16,777,216"),
        ("{{ 7 ** 1000000000 }}", "power"),
        ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "over"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError|ran over"),
    ],
)
def test_a_template_made_to_hang_is_stopped_in_one_line(tokenizers, source, words):
    """A template comes with a model file from anywhere: its time and size are bounded (the first
    ran until killed, the third took 24 s)."""
    import re
    import time

    started = time.perf_counter()
    with pytest.raises(JaxinferError) as refused:
        ChatTemplate(source, tokenizers[0].special_tokens).render(CONVERSATIONS["one turn"])
    assert re.search(words, str(refused.value)) and "\n" not in str(refused.value)
    assert time.perf_counter() - started < 60  # the budget is 5 s; the unbounded ran for hours


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "gpt-oss"])
def test_the_developer_role_is_the_system_role_where_the_template_has_none(tokenizers, name):
    template = ChatTemplate(TEMPLATES[name], tokenizers[0].special_tokens)
    said = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    text = template.render(said)
    assert "Answer in French." in text
    if name != "gpt-oss":  # harmony has a developer message of its own
        assert text == template.render([{**said[0], "role": "system"}, said[1]])


def test_a_role_the_template_cannot_render_is_refused_naming_it(tokenizers):
    special = tokenizers[0].special_tokens
    with pytest.raises(JaxinferError, match="no 'critic' role"):
        ChatTemplate(TEMPLATES["llama3"], special).render([{"role": "critic", "content": "x"}])
    with pytest.raises(JaxinferError, match="no 'critic' role"):
        ChatTemplate(None, special).render([{"role": "critic", "content": "x"}])
    drops_system = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(JaxinferError, match="leaves out a message of role 'system'"):
        ChatTemplate(drops_system, special).render(
            [{"role": "system", "content": "Be brief."}, CONVERSATIONS["one turn"][0]]
        )
