"""Text-level generation: prompt in, text pieces out, stop strings honoured, result and stats kept.

Layered on `Engine` (token ids) the way the CLI, chat and batch all use it:
    gen = Generation(model, engine, "The capital of France is", max_tokens=32)
    for piece in gen: print(piece, end="")
    gen.result()  # text, token ids, finish reason, seed, timings
If iteration is cut short (Ctrl-C), `gen.interrupt()` records it; everything produced so far is kept.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from jaxinfer.constrain import Constraint
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.perplexity import prompt_logprobs
from jaxinfer.sampling import Sampling
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


class Generation:
    def __init__(
        self,
        model: LoadedModel,
        engine: Engine,
        prompt: str | list[int],
        sampling: Sampling | None = None,
        max_tokens: int = 256,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        stream: bool = True,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        echo: bool = False,
        logit_bias: dict[int, float] | None = None,
    ):
        """`logprobs`: None, or how many most likely alternatives (≤ `sampling.TOP_LOGPROBS`) the
        result gives beside each token's own log-probability; `echo`: the prompt's tokens' too
        (`prompt_logprobs`, under the model's own distribution: `perplexity.prompt_logprobs`).
        `constraint`: what the output must match (`jaxinfer.constrain`); `logit_bias`: token id →
        added to its logit at every step (-inf: never)."""
        check_echo(echo, logprobs)
        self.prompt_ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._echoed = model if echo else None
        self.finish_reason: str | None = None
        self._tokenizer, self._top_n = model.tokenizer, logprobs
        self._tokens = engine.generate(
            self.prompt_ids,
            sampling or model.sampling,
            max_tokens,
            seed,
            stream,
            ignore_eos,
            logprobs is not None,
            constraint,
            model.tokenizer,
            logit_bias,
        )
        self._text = TextStream(model.tokenizer, self.prompt_ids, stop)

    @property
    def text(self) -> str:
        return self._text.text

    @property
    def token_ids(self) -> list[int]:
        return self._text.token_ids

    def __iter__(self) -> Iterator[str]:
        for chunk in self._tokens:
            for token in chunk:
                piece = self._text.push(token)
                if piece:
                    yield piece
                if self._text.stopped:
                    self.finish_reason = "stop"
                    return
        piece = self._text.flush()
        if piece:
            yield piece
        self.finish_reason = "stop" if self._text.stopped else self._tokens.finish_reason

    def interrupt(self) -> None:
        self.finish_reason = "interrupted"

    @property
    def timings(self):
        return self._tokens.timings

    def logprobs(self) -> list[dict] | None:
        """Where asked for, each generated token's (`logprob_entries`)."""
        if self._top_n is None:
            return None
        return logprob_entries(self._tokenizer, self.token_ids, self._tokens.logprobs, self._top_n)

    def prompt_logprobs(self) -> list[dict] | None:
        """Where `echo` asked for them, the prompt's tokens' (`prompt_logprob_entries`)."""
        if self._echoed is None:
            return None
        return prompt_logprob_entries(self._echoed, self.prompt_ids, self._top_n)

    def result(self) -> dict:
        logprobs, prompt = self.logprobs(), self.prompt_logprobs()
        return (
            {
                "text": self.text,
                "token_ids": self.token_ids,
                "prompt_tokens": len(self.prompt_ids),
                "generated_tokens": len(self.token_ids),
                "finish_reason": self.finish_reason,
                "seed": self._tokens.seed,
                "timings": self.timings.as_dict(),
            }
            | ({"logprobs": logprobs} if logprobs is not None else {})
            | ({"prompt_logprobs": prompt} if prompt else {})
        )
