"""A conversation rendered to prompt text by the model's Jinja chat template, as transformers'
`apply_chat_template` renders it: a sandboxed environment with `trim_blocks`/`lstrip_blocks`, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the special tokens
(`bos_token`, `eos_token`, ...) as variables, and `add_generation_prompt`.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jaxinfer import harmony
from jaxinfer.errors import JaxinferError
from jaxinfer.replies import REASONING_FORMATS, Reading, think_markers

# For models without a template: plain role-prefixed turns, documented in docs/usage.md. Generation
# stops at FALLBACK_STOP, where such a model would start writing the user's next turn.
FALLBACK_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}{{ '\\n\\n' }}"
    "{% elif m.role == 'user' %}{{ 'User: ' + m.content + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m.content + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
FALLBACK_STOP = "\nUser:"
FALLBACK_NOTICE = "this model has no chat template: using plain 'User:'/'Assistant:' turns"


def read_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """The template where transformers keeps it: chat_template.jinja (transformers 5), else
    tokenizer_config.json's `chat_template` (a string, or a list of named templates: 'default')."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# What rendering a conversation may take: a template comes with a model file from anywhere, and
# one with nested range() loops ran until killed, `'x' * 10**9` for 24 s before the context check.
RENDER_S = 5.0  # a template renders in milliseconds; a busy 2-core machine is still far inside this
RENDER_CHARS = 1 << 24  # 16 M characters: more than any context holds with any tokenizer here
_budget = threading.local()  # this thread's render deadline (the server renders in many threads)


def _over(what: str):
    return JaxinferError(f"the chat template {what}: it is not rendered (a template bug, or one made to hang)")


def _check_time() -> None:
    if time.perf_counter() > getattr(_budget, "deadline", float("inf")):
        raise _over(f"ran over {RENDER_S:g} s")


def _sized(value):
    """`value`, where it is text or a list within RENDER_CHARS."""
    if isinstance(value, (str, list, tuple)) and len(value) > RENDER_CHARS:
        raise _over(f"made a value of over {RENDER_CHARS:,} characters or items")
    return value


def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Budgeted(ImmutableSandboxedEnvironment):
        """transformers' sandbox, plus the render budget: the time is checked at every call a
        template makes (range() in a loop, a macro, a method) and every attribute it reads; a
        product, power or sum that would outgrow RENDER_CHARS is refused before it is made."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own spelling)
            _check_time()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            _check_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _check_time()
            return super().getitem(obj, argument)

        def call_binop(self, context, operator, left, right):
            _check_time()
            if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
            if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
                if len(left) * right > RENDER_CHARS:
                    raise _over(f"made a value of over {RENDER_CHARS:,} characters or items")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise _over("raised a number to a power over 64")
            return _sized(super().call_binop(context, operator, left, right))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


EFFORTS = ("low", "medium", "high")  # gpt-oss's reasoning efforts (OpenAI's `reasoning_effort`)
# the variables a template's caller sets itself: chat_template_kwargs may not
RESERVED = ("messages", "tools", "add_generation_prompt", "continue_final_message")


@dataclass(frozen=True)
class ChatOptions:
    """What shapes a chat prompt beyond its messages, and how its reply reads (llama-server's flags
    and fields of the same names): `kwargs`, more variables for the template (`chat_template_kwargs`:
    Qwen3's `enable_thinking`); `reasoning_format` "auto" (a thinking model's reasoning read apart
    from its answer: `jaxinfer.replies`) or "none" (left in the content); `reasoning_budget` -1 (the
    model thinks as it will), 0 (it does not: the template's switch off, else an empty block) or N
    (a thinking block is closed after N tokens, `reasoning_budget_message` written before its closing
    marker: `replies.bounded`)."""

    kwargs: dict = field(default_factory=dict)
    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""

    def __post_init__(self):
        check_kwargs(self.kwargs)
        if self.reasoning_format not in REASONING_FORMATS:
            raise JaxinferError(
                f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, not {self.reasoning_format!r}",
                "reasoning_format",
            )
        budget = self.reasoning_budget
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < -1:
            raise JaxinferError(
                "reasoning_budget must be -1 (unrestricted), 0 (no thinking) or the tokens a thinking block may hold",
                "reasoning_budget",
            )


def check_kwargs(kwargs) -> dict:
    """`chat_template_kwargs`: an object of template variables, none of those the caller sets."""
    if not isinstance(kwargs, dict):
        raise JaxinferError("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    taken = sorted(set(kwargs) & set(RESERVED))
    if taken:
        raise JaxinferError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request says it", "chat_template_kwargs"
        )
    return kwargs


class ChatTemplate:
    @classmethod
    def of(cls, model) -> ChatTemplate:
        """A loaded model's template (`loading.LoadedModel.chat_template`: its directory's, its GGUF
        file's, or the one it was loaded with)."""
        return cls(model.chat_template, model.tokenizer.special_tokens)

    def __init__(self, source: str | None, special_tokens: dict[str, str | None]):
        """`source` None means the model has none: FALLBACK_TEMPLATE is used (`is_fallback`)."""
        import jinja2

        self.is_fallback = source is None
        self.is_harmony = harmony.is_harmony(source)  # gpt-oss's (`jaxinfer.harmony`)
        self.source = source
        self.stop = (FALLBACK_STOP,) if self.is_fallback else ()
        self._special_tokens = special_tokens
        try:
            self._template = _environment().from_string(FALLBACK_TEMPLATE if source is None else source)
        except jinja2.TemplateError as e:
            raise JaxinferError(f"the model's chat template does not parse: {e}") from None

    def reasoning(self, effort: str | None, strict: bool = True) -> dict:
        """The variables that ask this template for a reasoning effort (gpt-oss's `reasoning_effort`):
        none where none is asked. A template that reads none refuses one (`strict`: a user's flag) or
        leaves it (an API client's field: OpenAI's clients send it to any model, as llama.cpp's
        server and ollama take it)."""
        if effort is None:
            return {}
        takes = "reasoning_effort" in (self.source or "")
        if not takes and not strict:
            return {}
        if effort not in EFFORTS:
            raise JaxinferError('reasoning_effort must be "low", "medium" or "high"', "reasoning_effort")
        if not takes:
            raise JaxinferError("this model's chat template takes no reasoning_effort", "reasoning_effort")
        return {"reasoning_effort": effort}

    def prompt(
        self,
        messages: list[dict],
        options: ChatOptions = ChatOptions(),
        calls: str | None = None,
        tools: list[dict] | None = None,
        continue_final: bool = False,
        **extra,
    ) -> tuple[str, Reading]:
        """The conversation rendered for the assistant's reply, and how that reply reads (`calls`: the
        format of its tool calls; `tools`, `extra`: as `render`). A budget of 0 turns thinking off by
        the template's own switch (`enable_thinking`), else by an empty block after the prompt.
        `continue_final`: the last message is the assistant's reply begun, to be continued (as
        transformers' `continue_final_message`: the text cut where that message's content ends)."""
        markers = think_markers(self.source)
        variables = {**options.kwargs, **extra}
        if options.reasoning_budget == 0 and markers:
            variables.setdefault("enable_thinking", False)
        if not continue_final:
            text = self.render(messages, tools=tools, **variables)
        else:
            begun = messages[-1].get("content") if messages[-1].get("role") == "assistant" else None
            if not isinstance(begun, str) or not begun.strip():
                raise JaxinferError(
                    "continue_final_message continues the last message: an assistant's, with text",
                    "continue_final_message",
                )
            variables.setdefault("add_generation_prompt", False)
            text = self.render(messages, tools=tools, **variables)
            at = text.rfind(begun.strip())
            if at < 0:
                raise JaxinferError(
                    "this model's chat template leaves out the message continue_final_message continues",
                    "continue_final_message",
                )
            text = text[: at + len(begun.strip())]
        opened = bool(markers) and text.rstrip().endswith(markers[0])
        if markers and continue_final:  # a reply begun inside its thinking block
            opened = markers[0] in begun and markers[1] not in begun.rsplit(markers[0], 1)[-1]
        replying = variables.get("add_generation_prompt", True) and not continue_final  # a reply starts here
        if options.reasoning_budget == 0 and markers and replying and (opened or "enable_thinking" not in self.source):
            text += ("" if opened else markers[0] + "\n\n") + markers[1] + "\n\n"
            opened = False
        return text, Reading(calls, markers if options.reasoning_format == "auto" else None, opened)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **extra
    ) -> str:
        """`tools`: OpenAI's function definitions, for templates that offer them to the model (`jaxinfer.tools`);
        `extra`: more variables some templates read (gpt-oss's `reasoning_effort`)."""
        import jinja2

        if self.is_harmony:  # gpt-oss's asks `"..." in message.content`: null (OpenAI's, beside calls) is no text
            messages = [{k: v for k, v in m.items() if not (k == "content" and v is None)} for m in messages]
        messages = self._roles(messages)
        variables = {"add_generation_prompt": add_generation_prompt, "tools": tools, **self._special_tokens, **extra}
        _budget.deadline, text, size = time.perf_counter() + RENDER_S, [], 0
        try:
            for piece in self._template.generate(messages=messages, **variables):
                size += len(piece)
                if size > RENDER_CHARS:
                    raise _over(f"wrote over {RENDER_CHARS:,} characters")
                text.append(piece)
                _check_time()
        except jinja2.TemplateError as e:  # raise_exception() in the template
            raise JaxinferError(f"chat template: {e}") from None
        except (
            TypeError,
            ValueError,
            AttributeError,
            KeyError,
            IndexError,
            RecursionError,
            MemoryError,
            OverflowError,
        ) as e:  # a template bug, or input it cannot take
            raise JaxinferError(f"chat template: {type(e).__name__}: {e}") from None
        finally:
            _budget.deadline = float("inf")
        text = "".join(text)
        for m in messages:  # a message the template left out would change the answer without a word
            said = m.get("content")
            if m["role"] not in ("assistant", "tool") and isinstance(said, str) and said.strip() not in text:
                raise JaxinferError(f"this model's chat template leaves out a message of role {m['role']!r}")
        return text

    def _roles(self, messages: list[dict]) -> list[dict]:
        """OpenAI's `developer` is the `system` of newer models: one for templates that know only
        `system`. A role the template does not name (and the fallback's four) is refused."""
        source = self.source or ""
        known = ("system", "user", "assistant", "tool")
        renamed = []
        for m in messages:
            role = m.get("role")
            if role == "developer" and (self.is_fallback or "developer" not in source):
                m = {**m, "role": "system"}
            elif role not in known and (self.is_fallback or f"'{role}'" not in source and f'"{role}"' not in source):
                raise JaxinferError(f"this model's chat template has no {role!r} role")
            renamed.append(m)
        return renamed
