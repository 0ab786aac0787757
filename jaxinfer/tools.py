"""Tool calling, OpenAI's way: a request's `tools` go to the model's chat template (which writes them
into the prompt as the model was trained to read them), and the calls the model writes back are
parsed out of its text in the format that template teaches:

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen 2.5
  and 3, Hermes 2 and 3, and the many fine-tunes on their templates);
- "mistral": `[TOOL_CALLS]` then a JSON list of {"name", "arguments"} (Mistral's v3 templates; the
  control token is not text, so a reply that is such a list alone counts too);
- "llama3": the whole reply a JSON object {"name", "parameters"} (Llama 3.1–3.3's JSON calling),
  after `<|python_tag|>` where the model writes one;
- "harmony": gpt-oss's messages on channels (`jaxinfer.harmony`), whose replies also hold the model's
  reasoning apart from its answer: every reply of such a template is read, tools or none.

A template that mentions `tools` in none of these formats takes no tools here: a request with tools
for it is refused rather than answered with calls nobody parses.
"""

from __future__ import annotations

import json
import re
import secrets

from jaxinfer import harmony
from jaxinfer.constrain import closed
from jaxinfer.errors import JaxinferError

FORMATS = ("hermes", "mistral", "llama3", "harmony")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


def format_of(template: str | None) -> str | None:
    """The tool-call format a chat template's source teaches, or None (no tools, or a format not parsed)."""
    if harmony.is_harmony(template):
        return "harmony"
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3"
    return None


def check_tools(tools, tool_choice) -> tuple[list[dict] | None, list[dict] | None]:
    """OpenAI's `tools` (a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}) and `tool_choice` checked: (the tools to render, or None where none are to be
    offered: no tools, or "none"; the tools one of which must be called, or None where the model
    chooses: "required" is any of them, {"type": "function", "function": {"name"}} that one)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise JaxinferError('"tool_choice" asks for a call, and "tools" gives none', "tool_choice")
        return None, None
    if not isinstance(tools, list) or not all(_is_function(t) for t in tools):
        raise JaxinferError(
            '"tools" must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}', "tools"
        )
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "none":
        return None, None
    if tool_choice == "required":
        return tools, tools
    named = isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict)
    chosen = [t for t in tools if named and t["function"]["name"] == tool_choice["function"].get("name")]
    if not chosen:
        raise JaxinferError(
            '"tool_choice" must be "auto", "none", "required" or {"type": "function", "function": {"name": '
            "one of the tools}}",
            "tool_choice",
        )
    return tools, chosen[:1]


def forced_grammar(tools: list[dict], fmt: str) -> str:
    """A Lark grammar (llguidance's, with JSON schemas inline) of replies that are calls of `tools`
    in format `fmt`, each call's arguments valid against its function's parameters: a forced call,
    decoded under it as any constraint is (`jaxinfer.constrain`)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    key: closed(t["function"].get("parameters") or {"type": "object"}),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in tools
        ],
    }
    # as `constrain.JSON_OPTIONS` (one space after ":" and ",", as the templates write calls), said outright:
    # inline schemas default to no spaces at all
    compact = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    if fmt == "hermes":
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        return f'start: block ("\\n" block)*\nblock: {block}\ncall: %json {json.dumps(calls | compact)}'
    if fmt == "mistral":  # its marker is a control token, not text: the list alone is a call
        listed = {"type": "array", "items": calls, "minItems": 1} | compact
        return f"start: calls\ncalls: %json {json.dumps(listed)}"
    return f"start: call\ncall: %json {json.dumps(calls | compact)}"


def _is_function(tool) -> bool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        return False
    function = tool["function"]
    return isinstance(function.get("name"), str) and isinstance(function.get("parameters", {}), dict)


def template_messages(messages: list[dict]) -> list[dict]:
    """Earlier tool calls as chat templates read them: OpenAI sends each call's `arguments` as a JSON
    text, templates write them with `tojson` and expect the object (as vLLM and transformers give)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                raise JaxinferError('a message\'s "tool_calls" must be a list of {"function": {"name", "arguments"}}')
            m = {**m, "tool_calls": [{**c, "function": _arguments_object(c["function"])} for c in calls]}
        out.append(m)
    return out


def _arguments_object(function: dict) -> dict:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise JaxinferError("a tool call's \"arguments\" must be a JSON object's text") from None
    return {**function, "arguments": arguments}


def _call(name, arguments) -> dict | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def call(name: str, arguments: str) -> dict | None:
    """A call of `name` in OpenAI's shape, its `arguments` the text the model wrote; None where that
    text is not a JSON object."""
    return _call(name, _json(arguments))


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def split(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """The reply as (content, tool calls in OpenAI's shape). A call that does not parse leaves the
    whole reply as content: what the model wrote is never lost."""
    if fmt == "hermes":
        blocks = _HERMES.findall(text)
        found = [_json(b) for b in blocks]
        calls = [_call(f.get("name"), f.get("arguments", {})) if isinstance(f, dict) else None for f in found]
        if not blocks or None in calls:
            return text, []
        content = text[: text.index("<tool_call>")].rstrip()  # as streamed (`streamable`), less the gap
        return content or None, calls
    stripped = text.strip()
    if fmt == "mistral":
        body = stripped.removeprefix(MARKERS["mistral"]).strip()
        found = _json(body) if body.startswith("[") else None
        if isinstance(found, list) and found:
            calls = [_call(f.get("name"), f.get("arguments", {})) if isinstance(f, dict) else None for f in found]
            if None not in calls:
                return None, calls
        return text, []
    body = stripped.removeprefix(MARKERS["llama3"]).strip()
    found = _json(body) if body.startswith("{") else None
    if isinstance(found, dict):
        call = _call(found.get("name"), found.get("parameters", found.get("arguments", {})))
        if call:
            return None, [call]
    return text, []


def streamable(text: str, fmt: str) -> int:
    """How much of the reply so far may be streamed as content: everything before where a call may
    be starting (the marker, or a prefix of it at the end; for the formats whose whole reply is the
    call, nothing while it may still become one)."""
    if fmt == "hermes":
        marker = MARKERS["hermes"]
        at = text.find(marker)
        if at >= 0:
            return at
        keep = max((n for n in range(1, len(marker)) if text.endswith(marker[:n])), default=0)
        return len(text) - keep
    stripped = text.lstrip()
    openers = ("[", MARKERS["mistral"]) if fmt == "mistral" else ("{", MARKERS["llama3"])
    if not stripped or any(o.startswith(stripped[: len(o)]) for o in openers):
        return 0
    return len(text)
