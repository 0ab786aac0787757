"""A conversation rendered to prompt text by the model's Jinja chat template, as transformers'
`apply_chat_template` renders it: a sandboxed environment with `trim_blocks`/`lstrip_blocks`, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the special tokens
(`bos_token`, `eos_token`, ...) as variables, and `add_generation_prompt`.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path

from jaxinfer import harmony
from jaxinfer.errors import JaxinferError

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


class ChatTemplate:
    @classmethod
    def of(cls, model) -> ChatTemplate:
        """A loaded model's template (`loading.LoadedModel`): its directory's, or its GGUF file's."""
        return cls(read_template(model.path, model.tokenizer.config), model.tokenizer.special_tokens)

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

    def reasoning(self, effort: str | None) -> dict:
        """The variables that ask this template for a reasoning effort (gpt-oss's `reasoning_effort`):
        none where none is asked; one it does not read is refused, not ignored."""
        if effort is None:
            return {}
        if effort not in EFFORTS:
            raise JaxinferError('reasoning_effort must be "low", "medium" or "high"', "reasoning_effort")
        if "reasoning_effort" not in (self.source or ""):
            raise JaxinferError("this model's chat template takes no reasoning_effort", "reasoning_effort")
        return {"reasoning_effort": effort}

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
