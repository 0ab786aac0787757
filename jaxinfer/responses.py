"""OpenAI's Responses API, stateless (`POST /v1/responses`), which Codex and the newer OpenAI SDKs
speak: a request read into our own shape (the one parser and scheduler), its answer written back
as a Response (output items: reasoning, the message, function calls), whole or as its stream of
typed events. The server (`jaxinfer.server`, `jaxinfer.protocols`) moves the bytes.

Read: `input` (a string, or items: messages whose content is a string or `input_text` /
`output_text` parts, `function_call` and `function_call_output`; earlier `reasoning` items dropped,
as the templates drop earlier reasoning), `instructions` (the system message), `max_output_tokens`,
`temperature`, `top_p`, `tools` (functions: {"type": "function", "name", "parameters"}),
`tool_choice`, `text.format` (`json_schema` or `json_object`: the answer decoded to match),
`reasoning.effort` (the template's, where it takes one), vLLM's `guided_*`. Accepted and ignored: `model`, `store`,
`metadata`, `user`, `parallel_tool_calls`, `service_tier`, `truncation`, `include`,
`prompt_cache_key`, `safety_identifier`, `reasoning.summary`, `text.verbosity`. Refused in one line:
`previous_response_id` and `conversation` (nothing is stored here: send the whole input), built-in
tools (web search, files, code), images and files, and any other field.
"""

from __future__ import annotations

import json
import secrets
import time

from jaxinfer.constrain import FIELDS as CONSTRAINT_FIELDS
from jaxinfer.errors import JaxinferError

GUIDED = tuple(f for f in CONSTRAINT_FIELDS if f.startswith("guided_"))

IGNORED = ("model", "store", "metadata", "user", "parallel_tool_calls", "service_tier", "truncation", "include")
IGNORED += ("prompt_cache_key", "safety_identifier", "stream_options")
KNOWN = {"input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "text"}
KNOWN |= {"reasoning", "previous_response_id", "conversation", *GUIDED}  # vLLM's guided_* (extra_body), as in chat


def response_id() -> str:
    return f"resp_{secrets.token_hex(12)}"


def to_item(body: dict) -> dict:
    """A Responses request body as our request fields (`api.Parser.parse` reads them)."""
    body = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise JaxinferError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}")
    for name in ("previous_response_id", "conversation"):
        if name in body:
            raise JaxinferError(f'"{name}": nothing is stored here; send the whole conversation as "input"')
    item = {"messages": _messages(body.get("input"), body.get("instructions"))}
    item |= {k: body[k] for k in GUIDED if k in body}
    if "max_output_tokens" in body:
        item["max_tokens"] = body["max_output_tokens"]
    item |= {k: body[k] for k in ("temperature", "top_p") if k in body}
    if body.get("tools"):
        item["tools"] = [_tool(t) for t in _list(body["tools"], "tools")]
    if "tool_choice" in body:
        choice = body["tool_choice"]
        named = isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice
        item["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}} if named else choice
    text = body.get("text") or {}
    given = text.get("format") if isinstance(text, dict) else None
    if isinstance(given, dict) and given.get("type") == "json_schema":
        schema = {"name": given.get("name", "output"), "schema": given.get("schema", {})}
        item["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(given, dict) and given.get("type") == "json_object":
        item["response_format"] = {"type": "json_object"}
    elif given not in (None, {"type": "text"}):
        raise JaxinferError('"text": format must be {"type": "text" | "json_object" | "json_schema", ...}')
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort in ("low", "medium", "high"):
        item["reasoning_effort"] = effort
    elif effort in ("none", "minimal"):
        item["chat_template_kwargs"] = {"enable_thinking": False}
    return item


def response_body(rid: str, model: str, record: dict, reply: tuple, created: float, status: str = "completed") -> dict:
    """A finished record as a Response; `reply`: its (reasoning, content, calls) (`Reading.reply`)."""
    reasoning, content, calls = reply
    cut = record["finish_reason"] in ("length", "unfinished", "cancelled") and not calls  # a call parsed is whole
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if cut else status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model,
        "output": output(rid, reasoning, content, calls),
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "usage": {
            "input_tokens": record["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": record.get("cached_tokens", 0)},
            "output_tokens": record["generated_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": record["prompt_tokens"] + record["generated_tokens"],
        },
    }


def output(rid: str, reasoning: str | None, content: str | None, calls: list[dict]) -> list[dict]:
    """The output items: the reasoning, the message (where there is text, or nothing else), each call."""
    key = rid.removeprefix("resp_")
    items = [reasoning_item(key, reasoning)] if reasoning else []
    if content or not (reasoning or calls):
        items.append(message_item(key, content or ""))
    return items + [call_item(c) for c in calls]


def reasoning_item(key: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{key}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(key: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": f"msg_{key}", "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict) -> dict:
    key = call["id"].removeprefix("call_")
    function = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{key}",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"],
        "status": "completed",
    }


async def events(pieces, rid: str, model: str):
    """The stream: response.created; per output item its added/delta/done events (reasoning_text,
    output_text, function_call_arguments); response.completed (or .incomplete) with the whole."""
    created, number = time.time(), 0
    key = rid.removeprefix("resp_")

    def event(kind: str, **data) -> str:
        nonlocal number
        number += 1
        said = json.dumps({"type": kind, "sequence_number": number, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {said}\n\n"

    shell = {"id": rid, "object": "response", "created_at": created, "model": model, "output": [], "error": None}
    shell |= {"parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
    yield event("response.created", response=shell | {"status": "in_progress"})
    open_kind, index, said = None, -1, {"reasoning": "", "text": ""}

    def close():
        if open_kind == "reasoning":
            yield event(
                "response.reasoning_text.done",
                item_id=f"rs_{key}",
                output_index=index,
                content_index=0,
                text=said["reasoning"],
            )
            yield event("response.output_item.done", output_index=index, item=reasoning_item(key, said["reasoning"]))
        elif open_kind == "text":
            part = {"type": "output_text", "text": said["text"], "annotations": [], "logprobs": []}
            yield event(
                "response.output_text.done",
                item_id=f"msg_{key}",
                output_index=index,
                content_index=0,
                text=said["text"],
                logprobs=[],
            )
            yield event(
                "response.content_part.done", item_id=f"msg_{key}", output_index=index, content_index=0, part=part
            )
            yield event("response.output_item.done", output_index=index, item=message_item(key, said["text"]))

    def start(kind: str):
        nonlocal open_kind, index
        yield from close()
        open_kind, index = kind, index + 1
        if kind == "reasoning":
            yield event(
                "response.output_item.added", output_index=index, item=reasoning_item(key, "") | {"content": []}
            )
        else:
            yield event(
                "response.output_item.added",
                output_index=index,
                item=message_item(key, "", "in_progress") | {"content": []},
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event(
                "response.content_part.added", item_id=f"msg_{key}", output_index=index, content_index=0, part=part
            )

    def add(kind: str, text: str):
        if not text:
            return
        if open_kind != kind:
            yield from start(kind)
        said[kind] += text
        if kind == "reasoning":
            yield event(
                "response.reasoning_text.delta", item_id=f"rs_{key}", output_index=index, content_index=0, delta=text
            )
        else:
            yield event(
                "response.output_text.delta",
                item_id=f"msg_{key}",
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )

    async for kind, *got in pieces:
        if kind == "failed":
            yield event("error", code="server_error", message=got[0], param=None)
            return
        if kind == "piece":
            for text in [*add("reasoning", got[1]), *add("text", got[2])]:
                yield text
            continue
        _, record, reasoning, content, calls = got
        for text in [*add("reasoning", reasoning), *add("text", content)]:
            yield text
        if open_kind is None and not calls:  # an empty answer is one empty message
            for text in start("text"):
                yield text
        for text in close():
            yield text
        for call in calls:
            index += 1
            item = call_item(call)
            yield event(
                "response.output_item.added", output_index=index, item=item | {"arguments": "", "status": "in_progress"}
            )
            yield event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
            yield event("response.output_item.done", output_index=index, item=item)
        whole = response_body(rid, model, record, (said["reasoning"] or None, said["text"] or None, calls), created)
        yield event(f"response.{'completed' if whole['status'] == 'completed' else 'incomplete'}", response=whole)


def _messages(given, instructions) -> list[dict]:
    """`input` (and `instructions`) as chat messages in OpenAI's chat shape."""
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(given, str):
        return out + [{"role": "user", "content": given}]
    for entry in _list(given, "input"):
        kind = entry.get("type", "message") if isinstance(entry, dict) else None
        if kind == "message" and entry.get("role") in ("user", "assistant", "system", "developer"):
            out.append({"role": entry["role"], "content": _text(entry.get("content"))})
        elif kind == "function_call":
            function = {"name": entry.get("name"), "arguments": entry.get("arguments", "{}")}
            call = {"id": entry.get("call_id"), "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": entry.get("call_id"), "content": _text(entry.get("output"))})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: the templates leave it out
        else:
            raise JaxinferError(f'an "input" item of type {kind!r} is not taken here: messages and function calls')
    if not out:
        raise JaxinferError('"input" must not be empty')
    return out


def _text(content) -> str:
    if isinstance(content, str):
        return content
    parts = _list(content, "content")
    if not all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text") for p in parts):
        raise JaxinferError("a message's content must be text (input_text parts): the model reads text only")
    return "".join(str(p.get("text", "")) for p in parts)


def _tool(tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise JaxinferError(
            '"tools" must be functions ({"type": "function", "name", "parameters"}): built-in tools are not offered'
        )
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise JaxinferError(f'"{where}" must be a string or a list')
    return value
