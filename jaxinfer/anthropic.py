"""Anthropic's Messages API, the protocol Claude Code and other agents speak (`POST /v1/messages`,
`/v1/messages/count_tokens`): a request read into our own shape (the one parser and scheduler every
driver uses), its result written back in Anthropic's shapes. The server (`jaxinfer.server`) moves
the bytes; this module says what they mean.

Read: `max_tokens` (required, as Anthropic requires it), `messages` (content a string or blocks:
`text`, `tool_use` in the assistant's turns, `tool_result` in the user's; `thinking` blocks of
earlier turns are dropped, as the templates drop earlier reasoning; a last assistant turn is the
reply begun, which the answer continues), `system` (a string or text
blocks), `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` ({name, description,
input_schema}), `tool_choice` (auto, any, tool, none), `thinking` ({"type": "disabled"} turns a
thinking model's thinking off; enabled is its default, its `budget_tokens` the tokens the thinking
block may hold), `output_config` (`format`: a JSON schema the answer is decoded to match; `effort`:
the template's reasoning effort, where it takes one), and
the older `temperature`, `top_p`, `top_k` (today's client sends them as `extra_body`). Accepted and
ignored: `IGNORED`, and `stream` (the server's). Images, documents, containers and the server-side
tools (web search, code execution, MCP) are refused in one line; so is any other field.
"""

from __future__ import annotations

import json
import secrets

from jaxinfer.errors import JaxinferError

# what changes nothing here: the model asked for (the answer names the one that ran), a prompt-cache
# marker (prefixes are reused on their own), where and how fast Anthropic would run it
IGNORED = (
    "model",
    "metadata",
    "service_tier",
    "cache_control",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
STOP_REASONS = {"length": "max_tokens", "unfinished": "max_tokens", "cancelled": "max_tokens"}


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def to_item(body: dict) -> dict:
    """A Messages request body as our request fields (`api.Parser.parse` reads them)."""
    body = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    known = {"max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools"}
    known |= {"tool_choice", "thinking", "output_config"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise JaxinferError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}", unknown[0])
    if "messages" not in body or "max_tokens" not in body:
        raise JaxinferError('"messages" and "max_tokens" are required, as Anthropic\'s API requires them', "max_tokens")
    item = {"messages": messages(body["messages"], body.get("system"))}
    if item["messages"][-1]["role"] == "assistant":  # Anthropic's prefill: the reply continues it
        item["continue_final_message"] = True
    for ours, theirs in (("max_tokens", "max_tokens"), ("stop", "stop_sequences"), ("temperature", "temperature")):
        if theirs in body:
            item[ours] = body[theirs]
    item |= {k: body[k] for k in ("top_p", "top_k") if k in body}
    if body.get("tools"):
        item["tools"] = [_tool(t) for t in _list(body["tools"], "tools")]
    if "tool_choice" in body:
        item["tool_choice"] = _tool_choice(body["tool_choice"])
    item |= _output_config(body.get("output_config", {}))
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise JaxinferError('"thinking" must be {"type": "enabled" | "disabled", ...}', "thinking")
        if thinking["type"] == "disabled":
            item["chat_template_kwargs"] = {"enable_thinking": False}
        elif "budget_tokens" in thinking:  # the thinking block closed after that many tokens
            item["thinking_budget_tokens"] = thinking["budget_tokens"]
    return item


def messages(given, system=None) -> list[dict]:
    """Anthropic's turns (and its top-level `system`) as chat messages in OpenAI's shape."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for m in _list(given, "messages"):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m:
            raise JaxinferError('"messages" must be a list of {"role": "user" | "assistant", "content"}')
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        text, calls = [], []
        for block in _list(content, "content"):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind in ("thinking", "redacted_thinking"):
                continue  # an earlier turn's reasoning: the templates leave it out
            elif kind == "tool_use" and m["role"] == "assistant":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                function = {"name": block.get("name"), "arguments": arguments}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            elif kind == "tool_result" and m["role"] == "user":
                result = block.get("content", "")
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _text(result, "tool_result")}
                )
            else:
                raise JaxinferError(
                    f"a {m['role']} message's {kind!r} block is not taken here: text"
                    + (", tool_use" if m["role"] == "assistant" else ", tool_result")
                    + " (the model reads text only)",
                )
        if text or calls or m["role"] == "assistant":
            message = {"role": m["role"], "content": "".join(text)}
            out.append(message | ({"tool_calls": calls} if calls else {}))
    if not out:
        raise JaxinferError('"messages" must not be empty')
    return out


def message_body(record: dict, reply: tuple, model: str, stop: list[str]) -> dict:
    """A finished record as a Message; `reply`: its (reasoning, content, calls) (`Reading.reply`)."""
    reasoning, content, calls = reply
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks(reasoning, content, calls),
        **stop_reason(record, calls, stop),
        "usage": usage(record),
    }


async def events(pieces, message: str, model: str, prompt_tokens: int, stop: list[str]):
    """Server-sent events in Anthropic's streaming shape from `pieces` (`Server._pieces`: one choice
    read as it comes): message_start; a content block at a time (thinking, text, each tool_use)
    with its deltas; message_delta with the stop reason and usage; message_stop."""
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    start = {"id": message, "type": "message", "role": "assistant", "model": model, "content": []}
    yield _event("message_start", {"message": start | {"stop_reason": None, "stop_sequence": None, "usage": usage}})
    block, index = None, -1  # the open block's kind, and its index

    def switch(kind: str, opening: dict):
        nonlocal block, index
        if block is not None:
            yield _event("content_block_stop", {"index": index})
        block, index = kind, index + 1
        yield _event("content_block_start", {"index": index, "content_block": opening})

    def deltas(reasoning: str, content: str):
        for kind, text, opening in (("thinking", reasoning, {"signature": ""}), ("text", content, {})):
            if text:
                if block != kind:
                    yield from switch(kind, {"type": kind, kind: ""} | opening)
                delta = {"type": f"{kind}_delta", kind: text}
                yield _event("content_block_delta", {"index": index, "delta": delta})

    async for kind, *said in pieces:
        if kind == "failed":
            yield _event("error", error_body(said[0], said[1]))
            return
        if kind == "piece":
            for text in deltas(said[1], said[2]):
                yield text
            continue
        _, record, reasoning, content, calls = said
        for text in deltas(reasoning, content):
            yield text
        if block is None and not calls:  # an empty answer is one empty text block
            for text in switch("text", {"type": "text", "text": ""}):
                yield text
        for call in calls:
            used = tool_use(call)
            for text in switch("tool_use", used | {"input": {}}):
                yield text
            delta = {"type": "input_json_delta", "partial_json": json.dumps(used["input"], ensure_ascii=False)}
            yield _event("content_block_delta", {"index": index, "delta": delta})
        yield _event("content_block_stop", {"index": index})
        reason = stop_reason(record, calls, stop)
        yield _event("message_delta", {"delta": reason, "usage": {"output_tokens": record["generated_tokens"]}})
        yield _event("message_stop", {})


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def blocks(reasoning: str | None, content: str | None, calls: list[dict]) -> list[dict]:
    out = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    out += [{"type": "text", "text": content}] if content or not (reasoning or calls) else []
    return out + [tool_use(c) for c in calls]


def tool_use(call: dict) -> dict:
    """An OpenAI-shaped call (`tools.call`) as a tool_use block."""
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


def stop_reason(record: dict, calls: list[dict], stop: list[str]) -> dict:
    """`stop_reason` and `stop_sequence`: a call, a stop sequence of the request's (named), the budget,
    or the turn's end (EOS, the template's own stop)."""
    matched = record.get("stop_string")
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if record["finish_reason"] == "stop" and matched in stop:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": STOP_REASONS.get(record["finish_reason"], "end_turn"), "stop_sequence": None}


def usage(record: dict) -> dict:
    return {
        "input_tokens": record["prompt_tokens"],
        "output_tokens": record["generated_tokens"],
        "cache_read_input_tokens": record.get("cached_tokens", 0),
    }


def error_body(message: str, status: int) -> dict:
    kinds = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
    kind = kinds.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _tool(tool) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
        raise JaxinferError(
            '"tools" must be a list of {"name", "description", "input_schema"} (server tools such as web search '
            "are not offered here)",
            "tools",
        )
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice) -> object:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise JaxinferError(
        '"tool_choice" must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name"}', "tool_choice"
    )


def _output_config(config) -> dict:
    """`output_config`: its `format` (a JSON schema the answer must match) as our constraint; its
    `effort` as `reasoning_effort` (where the template takes one: gpt-oss's three, the two above
    Anthropic's high read as high)."""
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise JaxinferError('"output_config" takes "format" ({"type": "json_schema", "schema"}) and "effort"')
    item = {}
    if config.get("effort") is not None:
        if config["effort"] not in EFFORTS:
            raise JaxinferError(f'"output_config": effort must be one of {", ".join(EFFORTS)}')
        item["reasoning_effort"] = EFFORTS[config["effort"]]
    given = config.get("format")
    if given is not None:
        if (
            not isinstance(given, dict)
            or given.get("type") != "json_schema"
            or not isinstance(given.get("schema"), dict)
        ):
            raise JaxinferError('"output_config": format must be {"type": "json_schema", "schema": {...}}')
        item["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": given["schema"]}}
    return item


def _text(value, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(value, str):
        return value
    parts = _list(value, where)
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise JaxinferError(f'"{where}" must be text, or a list of text blocks (the model reads text only)')
    return "".join(p["text"] for p in parts)


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise JaxinferError(f'"{where}" must be a list')
    return value
