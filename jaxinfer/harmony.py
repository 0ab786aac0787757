"""OpenAI's harmony format, the one gpt-oss writes: a reply is messages, each a header and a body,

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the first message's `<|start|>assistant` is the prompt's, written by the chat template). The channel
says what a body is: "analysis" the model's reasoning, "final" the answer, "commentary" a call of the
tool its recipient names (`to=functions.NAME`, the arguments the body) or, with no recipient, a
preamble the user may see. The markers are special tokens, which decoding otherwise leaves out
(the reply then reads "analysisWe need…assistantfinalHello"); for a model whose chat template is in
this format the tokenizer keeps them (`Tokenizer.keep`), and this module reads the text.

Parsed as llama.cpp's `common_chat_parse_gpt_oss` and OpenAI's harmony guide read it: analysis into
the reasoning, final and preambles into the content, calls into OpenAI's `tool_calls`; text before
any marker (a model that skips the header) is content. A call whose body is not a JSON object stays
in the content: what the model wrote is never lost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
_SPLIT = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+)")


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokens a reply ends at: its answer's `<|return|>`, a call's `<|call|>` (generation_config.json
    lists both beside `<|endoftext|>`; a GGUF file names one EOS, and llama.cpp adds these as it does)."""
    return tuple(i for t in ("<|return|>", "<|call|>") if (i := tokenizer.token_id(t)) is not None)


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's: its messages have channels)."""
    return bool(template) and "<|channel|>" in template and "<|message|>" in template


@dataclass
class Message:
    role: str  # after <|start|>: "assistant", or "assistant to=functions.f" (a recipient may sit here)
    channel_text: str  # after <|channel|>: "analysis", "commentary to=functions.f"
    body: str

    @property
    def channel(self) -> str:
        words = self.channel_text.split()
        return words[0] if words else ""

    @property
    def recipient(self) -> str | None:
        found = _RECIPIENT.search(f"{self.role} {self.channel_text}")
        return found.group(1) if found else None


def messages(text: str) -> list[Message]:
    """The reply's messages in order, the last perhaps still being written (while its header is,
    with an empty body). A message cut off by the next one's `<|start|>` keeps what it said."""
    parts = _SPLIT.split(text)  # text, marker, text, marker, ...
    out: list[Message] = []
    if parts[0].strip():  # text before any marker (a model that skipped the header): content
        out.append(Message("assistant", "final", parts[0]))
    header: dict[str, str] = {}  # the header's text after each of its markers
    body: list[str] | None = None  # None: in the header
    after = ""

    def close() -> None:
        if any(header.values()) or body:
            out.append(Message(header.get("<|start|>", ""), header.get("<|channel|>", ""), "".join(body or ())))

    for part in parts[1:]:
        if part in _ENDS or part == "<|start|>":
            close()
            header, body, after = {}, None, part
        elif part == "<|message|>":
            body = []
        elif part in MARKERS:  # <|channel|>, <|constrain|>: the header goes on
            after = part
        elif body is not None:
            body.append(part)
        elif part.strip():
            header[after] = header.get(after, "") + part.strip()
    close()
    return out


def _whole_markers(text: str) -> str:
    """`text` less a marker's beginning at its end (a stream cut mid-marker)."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) and m != text[-k:] for m in MARKERS):
            return text[:-k]
    return text


def split(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls as (name, arguments' text)) of a reply."""
    reasoning, content, calls = [], [], []
    for m in messages(text):
        if m.channel == "analysis":
            reasoning.append(m.body)
        elif _called(m):  # its end, <|call|>, is an EOS: not in the text
            calls.append((_called(m), m.body.strip()))
        else:  # the answer, a preamble; a message to a tool other than a function: as written
            content.append(m.body)
    return _joined(reasoning) or None, _joined(content) or None, calls


def visible(text: str) -> tuple[str, str]:
    """(reasoning, content) of a reply so far, as `split` will end them: calls, headers and markers
    left out (a stream's text to show as it comes; a header, recipient and all, ends before its body)."""
    reasoning, content = [], []
    for m in messages(_whole_markers(text)):  # a marker cut short at the end: not shown
        if m.channel == "analysis":
            reasoning.append(m.body)
        elif not _called(m):
            content.append(m.body)
    return _joined(reasoning), _joined(content)


def _called(m: Message) -> str | None:
    """The function a message calls (its recipient `functions.NAME`), or None."""
    recipient = m.recipient
    return recipient.removeprefix("functions.") if recipient and recipient.startswith("functions.") else None


def _joined(bodies: list[str]) -> str:
    return "\n\n".join(b for b in bodies if b)
