"""Streaming detokenisation is exact: the streamed pieces always add up to decode(all ids)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.tokenizer import StreamDecoder, Tokenizer


@pytest.fixture(scope="module", params=["bpe", "sentencepiece"])
def tokenizer(request, tiny):
    return Tokenizer(tiny("llama", tokenizer=request.param))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_concatenation_equals_full_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize(
    "text", ["東京は日本の首都です。", "Emoji 🙂🚀 and ünïcödé", "The capital of France is Paris."]
)
def test_stream_of_real_text_one_token_at_a_time(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)  # never a half character on screen
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(ids) == text


def test_a_control_token_between_pushes_is_no_left_context(tokenizer):
    """A token that adds no text (BOS here) between two words: the second keeps its space (the
    window reaches back past the control token; hypothesis found this with sentencepiece)."""
    first, second = tokenizer.encode("The capital", add_special_tokens=False)[:2]
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(ids) for ids in ([first], [tokenizer.bos_id], [second])]
    assert "".join(pieces) + decoder.flush() == tokenizer.decode([first, tokenizer.bos_id, second])


def test_continuation_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    rest = tokenizer.encode("The capital of France is Paris", add_special_tokens=True)[len(prompt) :]
    decoder = StreamDecoder(tokenizer, prompt)
    assert "".join(decoder.push([i]) for i in rest) + decoder.flush() == " Paris"
