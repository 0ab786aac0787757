"""A sequence's tokens as text: exact streaming detokenisation, stop strings held back until they
can no longer match, and log-probabilities in OpenAI's shapes. Every driver's text goes through here
(`Generation` for run and chat, the scheduler's rows for batch and serve)."""

from __future__ import annotations

import numpy as np

from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.perplexity import prompt_logprobs
from jaxinfer.tokenizer import StreamDecoder, Tokenizer

# A request's stop strings at most (OpenAI allows 4; agents' fill-in-the-middle sends a dozen), and
# characters in each: the matcher is built per request, its cost grows with their total length.
MAX_STOPS, MAX_STOP_CHARS = 64, 256


def check_stops(stops) -> tuple[str, ...]:
    """Stop strings a request may give (within MAX_STOPS and MAX_STOP_CHARS), empty ones dropped."""
    stops = tuple(s for s in stops if s)
    if len(stops) > MAX_STOPS:
        raise JaxinferError(f"{len(stops)} stop strings: at most {MAX_STOPS} are taken", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise JaxinferError(f"a stop string is over {MAX_STOP_CHARS} characters", "stop")
    return stops


class StopStrings:
    """Cuts the text stream at the first stop string. Text that could still become a stop string is
    held back, so no stop string, nor a prefix of one split across tokens, ever reaches the output.

    One Aho-Corasick automaton over all the strings: each character of text moves it once, however
    many strings there are (checking each string against the held text took 15.8 s for 200 tokens
    with 5,000 strings of 100 characters, and slowed every row beside it). A state is a prefix of
    some stop string: the longest that the text ends with, so its length is what is held back."""

    def __init__(self, stops: tuple[str, ...]):
        self._next: list[dict[str, int]] = [{}]  # the trie of the strings' prefixes; state 0 is ""
        self._depth, ends = [0], [0]  # a state's length; a whole string's length where one ends there
        for stop in (s for s in stops if s):
            state = 0
            for ch in stop:
                if ch not in self._next[state]:
                    self._next[state][ch] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[state] + 1)
                    ends.append(0)
                state = self._next[state][ch]
            ends[state] = len(stop)
        # fail: the longest proper suffix of a state that is a state too; found, breadth first
        self._fail, self._found = [0] * len(self._next), ends  # found: the longest string the state ends with
        frontier = list(self._next[0].values())
        while frontier:
            deeper = []
            for state in frontier:
                for ch, child in self._next[state].items():
                    fail = self._fail[state]
                    while fail and ch not in self._next[fail]:
                        fail = self._fail[fail]
                    self._fail[child] = self._next[fail].get(ch, 0) if state else 0
                    self._found[child] = self._found[child] or self._found[self._fail[child]]
                    deeper.append(child)
            frontier = deeper
        self._state, self._held = 0, ""
        self.matched: str | None = None  # the stop string found

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found: the text is cut where the first
        found in this piece begins)."""
        held, state, first = len(self._held), self._state, None
        for i, ch in enumerate(text):
            while state and ch not in self._next[state]:
                state = self._fail[state]
            state = self._next[state].get(ch, 0)
            if self._found[state]:
                start = held + i + 1 - self._found[state]
                if first is None or start < first:
                    first, length = start, self._found[state]
        text, self._state = self._held + text, state
        if first is not None:
            self._held, self.matched = "", text[first : first + length]
            return text[:first], True
        keep = self._depth[state]
        out, self._held = text[: len(text) - keep], text[len(text) - keep :]
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

    @property
    def stop_string(self) -> str | None:
        """The stop string the text ended at, if it did."""
        return self._stops.matched


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
