"""How a chat reply reads: (reasoning, content, tool calls), and what of it may be shown as it comes.

Thinking models write their reasoning before the answer. Two ways are read here:
- in marked blocks the chat template names: `<think>…</think>` (Qwen3 and 3.5, QwQ, DeepSeek-R1 and
  its distills, SmolLM3, GLM-4.5 and later), `[THINK]…[/THINK]` (Magistral) or Gemma 4's thought
  channel, `<|channel>thought…<channel|>`. A template may open
  the block itself (DeepSeek-R1's and Qwen3-Thinking's generation prompts end in `<think>`): the
  reply then starts inside it (`Reading.opened`), as llama.cpp's "thinking forced open";
- harmony's `analysis` channel (gpt-oss: `jaxinfer.harmony`).
As llama.cpp's `--reasoning-format auto` reads them: the block's text, stripped, is the reasoning;
what follows is the content, itself read for tool calls (`jaxinfer.tools`); a block never closed
(the budget ran out while thinking) is all reasoning. A reply that does not start with a block is
all content: a template that lets the model skip thinking (Qwen3's `enable_thinking: false` writes an
empty block into the prompt) loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer import harmony, tools
from jaxinfer.errors import JaxinferError

# Gemma 4's block is its `thought` channel: `<|channel>thought\n…<channel|>` (its switch, enable_thinking,
# writes `<|think|>` into the system turn; off, the generation prompt closes an empty block)
THINK_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"), ("<|channel>thought", "<channel|>"))
REASONING_FORMATS = ("auto", "none")  # llama.cpp's --reasoning-format: read apart, or left in the content


def think_markers(template: str | None) -> tuple[str, str] | None:
    """The thinking block's (open, close) markers a chat template writes, or None."""
    return next((m for m in THINK_MARKERS if template and m[1] in template), None)


@dataclass(frozen=True)
class Reading:
    """`calls`: the tool calls' format (`tools.FORMATS`; None: none offered; "harmony" also holds the
    reasoning); `think`: the (open, close) markers of a thinking block, where reasoning is read
    apart; `opened`: the prompt ended inside a thinking block (read apart or not)."""

    calls: str | None = None
    think: tuple[str, str] | None = None
    opened: bool = False

    def __bool__(self) -> bool:
        return bool(self.calls or self.think)

    def reply(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, tool calls in OpenAI's shape). A call that does not parse stays in the
        content, as written."""
        if self.calls == "harmony":
            reasoning, content, found = harmony.split(text)
            calls = []
            for name, arguments in found:
                call = tools.call(name, arguments)
                if call:
                    calls.append(call)
                else:
                    content = "\n\n".join(filter(None, (content, arguments)))
            return reasoning, content, calls
        if not self:
            return None, text, []
        reasoning, rest = self._thought(text, whole=True)
        content, calls = tools.split(rest, self.calls) if self.calls else (rest, [])
        return reasoning or None, content or None, calls

    def visible(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a reply so far that may be shown as it comes: what `reply` will
        end with, less what may still turn out a marker or a call (each only grows)."""
        if self.calls == "harmony":
            return harmony.visible(text)
        reasoning, rest = self._thought(text, whole=False)
        return reasoning, rest[: tools.streamable(rest, self.calls)] if self.calls else rest

    def _thought(self, text: str, whole: bool) -> tuple[str, str]:
        """(the reasoning, the text after its block). Not `whole` (a stream so far): a marker's
        beginning at the end is held back, and so is trailing space (the end strips it)."""
        if not self.think:
            return "", text
        open_, close = self.think
        body = text.lstrip()
        if not whole and open_.startswith(body):  # the block (or the marker the prompt opened, again) may be starting
            return "", ""
        if body.startswith(open_):  # a model may write the marker the prompt opened, too
            body = body[len(open_) :]
        elif not self.opened:
            return "", text
        end = body.find(close)
        if end < 0:  # still thinking (or cut off while it was)
            if not whole:
                body = _less_partial(body, close)
            return body.strip(), ""
        return body[:end].strip(), body[end + len(close) :].lstrip()


@dataclass(frozen=True)
class Thinking:
    """A thinking block bounded in the decode loop (llama.cpp's `--reasoning-budget N`): once a block
    holds `tokens` tokens, a `message` and its closing marker are written (`forced`), and the model
    goes on to its answer. The block is open from the reply's start where the prompt opened it
    (`opened`), else from when the model writes the `opener`; one the model closes itself (`closer`)
    ends the count. Markers as token ids (`sampling.Guards` applies them)."""

    tokens: int
    opened: bool
    opener: tuple[int, ...]
    closer: tuple[int, ...]
    message: tuple[int, ...] = ()

    @property
    def markers(self) -> tuple[tuple[int, ...], ...]:
        """(opener, closer, forced): what `sampling.Guards` holds for every row."""
        return self.opener, self.closer, self.message + self.closer


def bounded(budget: int, template: str | None, opened: bool, tokenizer, message: str = "") -> Thinking | None:
    """The bound a reasoning budget sets on a reply to a prompt of this template (`message`: written
    before the closer): None for -1 (none) and 0 (the template already turned thinking off), and for
    a model that does not think."""
    if budget <= 0:
        return None
    if harmony.is_harmony(template):
        raise JaxinferError(
            "reasoning_budget N is not offered in harmony's format (gpt-oss): its reasoning_effort says how "
            "long it thinks",
            "reasoning_budget",
        )
    markers = think_markers(template)
    if markers is None:
        return None
    opener, closer, said = (tuple(tokenizer.encode(m, add_special_tokens=False)) for m in (*markers, message))
    return Thinking(budget, opened, opener, closer, said if message else ())


def _less_partial(text: str, marker: str) -> str:
    """`text` less a beginning of `marker` at its end (a stream cut mid-marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
