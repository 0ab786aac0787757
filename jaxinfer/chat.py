"""A multi-turn conversation over one Engine.

Each turn renders the whole conversation with the model's chat template and hands the token ids to
the engine, which prefills only what its KV cache does not hold yet (the longest common prefix with
the previous turn's prompt and reply is reused). The decode path is the one `run` uses.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.chat_template import ChatOptions, ChatTemplate
from jaxinfer.constrain import Constraint
from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError
from jaxinfer.generate import Generation
from jaxinfer.loading import LoadedModel
from jaxinfer.processes import share
from jaxinfer.replies import Reading, bounded
from jaxinfer.sampling import Sampling

ON_FULL = ("drop-oldest", "error")


class ChatSession:
    def __init__(
        self,
        model: LoadedModel,
        engine: Engine,
        sampling: Sampling,
        max_tokens: int,
        system: str | None = None,
        on_full: str = "drop-oldest",
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        constraint: Constraint | None = None,
        logit_bias: dict[int, float] | None = None,
        reasoning_effort: str | None = None,
        options: ChatOptions = ChatOptions(),
    ):
        if on_full not in ON_FULL:
            raise JaxinferError(f"on_full must be one of {', '.join(ON_FULL)}, not {on_full!r}", "on_full")
        self.model, self.engine, self.sampling = model, engine, sampling
        self.max_tokens, self.on_full, self.seed = max_tokens, on_full, seed
        self.stop, self.ignore_eos = stop, ignore_eos  # on top of the template's own stop strings
        self.system, self.constraint = system, constraint  # every reply matches the constraint
        self.logit_bias = logit_bias
        self.messages: list[dict] = []  # user and assistant turns, oldest first
        self.template = ChatTemplate.of(model)
        self.options = options  # template variables, and how a thinking model's replies read
        self.variables = self.template.reasoning(reasoning_effort)  # gpt-oss's effort, where asked
        self.reading = Reading()  # how the last turn's reply reads (its prompt may open a thinking block)
        self.context_used = 0  # tokens of the last turn's prompt and reply

    def conversation(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def prompt_ids(self) -> list[int]:
        """The conversation rendered, ready for the assistant's reply (and `reading` set for it). The
        template writes the special tokens itself, so none are added here (as transformers'
        apply_chat_template)."""
        calls = "harmony" if self.template.is_harmony else None  # gpt-oss: its reasoning read apart
        text, self.reading = self.template.prompt(self.conversation(), self.options, calls, **self.variables)
        return self.model.tokenizer.encode(text, add_special_tokens=False)

    def ask(self, text: str) -> tuple[Generation, list[str]]:
        """Start the reply to a user message: the generation to stream, and notices for the user
        (turns dropped to make room). If it cannot fit, the message is not kept and this raises."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids, notices = self._fit()
        except JaxinferError:
            self.messages.pop()
            raise
        budget = min(self.max_tokens, self.engine.max_context - len(ids))
        seed = None if self.seed is None else self.seed + len(self.messages)  # reproducible, not repeated
        gen = Generation(
            self.model,
            self.engine,
            ids,
            self.sampling,
            budget,
            seed,
            self.template.stop + self.stop,
            ignore_eos=self.ignore_eos,
            constraint=self.constraint,
            logit_bias=self.logit_bias,
            thinking=bounded(
                self.options.reasoning_budget,
                self.template.source,
                self.reading.opened,
                self.model.tokenizer,
                self.options.reasoning_budget_message,
            ),
        )
        return gen, notices

    def record(self, gen: Generation) -> None:
        """Keep the reply (also a partial, interrupted one) in the conversation: its answer (a thinking
        model's reasoning is not, as the templates of gpt-oss, Qwen3 and DeepSeek-R1 drop it from
        earlier turns)."""
        text = self.reading.reply(gen.text)[1] or ""
        self.messages.append({"role": "assistant", "content": text})
        self.context_used = len(gen.prompt_ids) + len(gen.token_ids)

    def _fit(self) -> tuple[list[int], list[str]]:
        """Prompt ids leaving room for a reply of max_tokens (or, with nothing left to drop, at
        least one token), dropping the oldest turns if `on_full` allows it."""
        context, notices = self.engine.max_context, []
        ids = self.prompt_ids()
        while len(ids) + self.max_tokens > context and len(self.messages) > 1:
            if self.on_full == "error":
                raise JaxinferError(
                    f"the conversation ({len(ids)} tokens) and a reply of up to {self.max_tokens} tokens exceed the "
                    f"context of {context}: reset, or start with on_full drop-oldest or a larger max_context",
                    "reset",
                    "on_full",
                    "max_context",
                )
            dropped = 2 if len(self.messages) > 2 and self.messages[1]["role"] == "assistant" else 1
            del self.messages[:dropped]
            ids = self.prompt_ids()
            notices.append(f"context full: dropped the oldest turn ({len(ids)} tokens now)")
        if len(ids) >= context:
            raise JaxinferError(
                f"the message is too long: {len(ids)} tokens with the chat template, context is {context}"
            )
        return ids, notices

    def reset(self) -> None:
        self.messages = []
        self.context_used = 0

    def save(self, path: Path) -> None:
        """Write the conversation to `path` (the first process of several writes it)."""
        data = {"system": self.system, "messages": self.messages}

        def write() -> None:
            try:
                path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n")
            except OSError as e:
                raise JaxinferError(f"cannot write {path}: {e.strerror}") from None

        share(write)

    def load(self, path: Path) -> None:
        """Continue the conversation saved in `path` (as the first process of several reads it)."""
        self.system, self.messages = share(lambda: _read_saved(path))


def _read_saved(path: Path) -> tuple[str | None, list[dict]]:
    try:
        data = json.loads(path.read_text())
        system, messages = data.get("system"), data["messages"]
        if not all(m["role"] in ("user", "assistant") and isinstance(m["content"], str) for m in messages):
            raise ValueError("messages must be user/assistant turns with text content")
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise JaxinferError(f"{path} is not a saved chat ({e})") from None
    return system, [{"role": m["role"], "content": m["content"]} for m in messages]
