"""A conversation rendered to prompt text by the model's Jinja chat template, as transformers'
`apply_chat_template` renders it: a sandboxed environment with `trim_blocks`/`lstrip_blocks`, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the special tokens
(`bos_token`, `eos_token`, ...) as variables, and `add_generation_prompt`.
"""

from __future__ import annotations

import json
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


def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **self._special_tokens,
                **extra,
            )
        except jinja2.TemplateError as e:  # raise_exception() in the template
            raise JaxinferError(f"chat template: {e}") from None
        except (
            TypeError,
            ValueError,
            AttributeError,
            KeyError,
            IndexError,
        ) as e:  # a template bug, or input it cannot take
            raise JaxinferError(f"chat template: {type(e).__name__}: {e}") from None
