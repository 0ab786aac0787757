"""Text-level generation: prompt in, text pieces out, stop strings honoured, result and stats kept.

Layered on `Engine` (token ids) the way run and chat use it (the text itself: `jaxinfer.text`):
    gen = Generation(model, engine, "The capital of France is", max_tokens=32)
    for piece in gen: print(piece, end="")
    gen.result()  # text, token ids, finish reason, seed, timings
If iteration is cut short (Ctrl-C), `gen.interrupt()` records it; everything produced so far is kept.
"""

from __future__ import annotations

from typing import Iterator

from jaxinfer.constrain import Constraint
from jaxinfer.engine import Engine
from jaxinfer.loading import LoadedModel
from jaxinfer.replies import Thinking
from jaxinfer.sampling import Sampling
from jaxinfer.text import TextStream, check_echo, logprob_entries, prompt_logprob_entries


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
        thinking: Thinking | None = None,
    ):
        """`logprobs`: None, or how many most likely alternatives (≤ `sampling.TOP_LOGPROBS`) the
        result gives beside each token's own log-probability; `echo`: the prompt's tokens' too
        (`prompt_logprobs`, under the model's own distribution: `perplexity.prompt_logprobs`).
        `constraint`: what the output must match (`jaxinfer.constrain`); `logit_bias`: token id →
        added to its logit at every step (-inf: never); `thinking`: a thinking block's budget
        (`replies.bounded`)."""
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
            thinking,
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
