"""A sequence's tokens as text: exact streaming detokenisation, stop strings held back until they
can no longer match, and log-probabilities in OpenAI's shapes. Every driver's text goes through here
(`Generation` for run and chat, the scheduler's rows for batch and serve)."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.perplexity import prompt_logprobs
from jaxinfer.tokenizer import StreamDecoder, Tokenizer


class StopStrings:
    """Cuts the text stream at the first stop string. Text that could still become a stop string is
    held back, so no stop string, nor a prefix of one split across tokens, ever reaches the output."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        self._held += text
        hits = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if hits:
            out, self._held = self._held[: min(hits)], ""
            return out, True
        keep = max((n for s in self._stops for n in range(1, len(s)) if self._held.endswith(s[:n])), default=0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out, False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class TextStream:
    """One sequence's new token ids → text pieces: exact streaming detokenisation, and stop strings
    honoured (generation should end once `stopped` is set). `text` and `token_ids` keep the whole.
    Without a tokenizer (benchmarks of random-weight shapes) it keeps the ids only."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._decoder = StreamDecoder(tokenizer, prompt_ids) if tokenizer else None
        self._stops = StopStrings(stop)

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        if self._decoder is None:
            return ""
        piece, self.stopped = self._stops.feed(self._decoder.push([token]))
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text held back at the end of the sequence."""
        if self._decoder is None:
            return ""
        piece, stopped = self._stops.feed(self._decoder.flush())
        piece = piece if stopped else piece + self._stops.flush()
        self.stopped |= stopped
        self.text += piece
        return piece


def logprob_entries(tokenizer: Tokenizer, tokens: list[int], logprobs: list, top_n: int) -> list[dict]:
    """Each token with its log-probability and the `top_n` most likely tokens at its position, in
    the shape of OpenAI's chat completions (`logprobs.content`): token text, logprob, UTF-8 bytes
    (a token may hold part of a character: its text then shows U+FFFD, its bytes are exact).
    Alternatives a constraint forbids (log-probability -inf) are left out.
    `logprobs`: per token (chosen, ids [N], top [N]), as `TokenStream.logprobs` gathers them."""

    def entry(token: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return [
        entry(token, chosen)
        | {"top_logprobs": [entry(int(i), float(x)) for i, x in zip(ids[:top_n], top[:top_n]) if x > -np.inf]}
        for token, (chosen, ids, top) in zip(tokens, logprobs)
    ]


def check_echo(echo: bool, logprobs: int | None) -> None:
    if echo and logprobs is None:
        raise JaxinferError("echo gives the prompt's log-probabilities: it needs logprobs", "echo", "logprobs")


def prompt_logprob_entries(model: LoadedModel, ids: list[int], top_n: int) -> list[dict]:
    """A prompt's tokens as `logprob_entries`, scored by `perplexity.prompt_logprobs`, the first with
    none (nothing comes before it): what OpenAI's `echo` gives."""
    scored = prompt_logprobs(model.config, model.params, ids)
    return logprob_entries(model.tokenizer, ids, [(None, (), ())] + scored, top_n)
