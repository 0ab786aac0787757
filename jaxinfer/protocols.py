"""The HTTP protocols `jaxinfer serve` speaks, each a thin adapter over the one parser and scheduler:
how a request body is read into our own shape (`read`), and how its answer is written, whole
(`whole`) or streamed (`stream`, from `Server._pieces`: each choice read as it comes). The server
moves the bytes; `PROTOCOLS` says which endpoint speaks which.

- OpenAI's chat and text completions (`jaxinfer.api`): server-sent events, `data: [DONE]` at the end;
- OpenAI's Responses, stateless (`jaxinfer.responses`): its typed events;
- Anthropic's Messages (`jaxinfer.anthropic`): its typed events;
- ollama's chat and generate (`jaxinfer.ollama`): newline-delimited JSON, streamed unless asked not;
- llama-server's /completion and /infill (`jaxinfer.utilities`): its own shape, server-sent events.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from jaxinfer import anthropic, ollama, responses, utilities
from jaxinfer.api import finish_reason, from_openai, openai_body, openai_chunk, response_id, usage_chunk
from jaxinfer.errors import JaxinferError
from jaxinfer.replies import Reading

MAX_N = 16  # choices per request at most


@dataclass
class Call:
    """One request as a protocol read it: our request fields (`item`; None where the protocol
    answers at once with `answer`), its choices, whether it streams; and what its answer needs."""

    item: dict | None
    id: str
    n: int = 1
    stream: bool = False
    extra: dict = field(default_factory=dict)  # the protocol's own: OpenAI's include_usage, Anthropic's stop
    answer: dict | None = None
    model: str = ""  # the served model's name
    reading: Reading = field(default_factory=Reading)
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Protocol:
    read: Callable[[str, dict], Call]
    whole: Callable[[str, Call, list[dict]], dict]
    stream: Callable[[str, Call, AsyncIterator], AsyncIterator[str]]
    error: Callable[[str, int], dict] | None = None  # its error body (None: OpenAI's)
    media: str = "text/event-stream"


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _flag(body: dict, name: str, default: bool) -> bool:
    """A driver's field (removed from `body`): true or false, null as not given."""
    value = body.pop(name, None)
    value = default if value is None else value
    if not isinstance(value, bool):
        raise JaxinferError(f'"{name}" must be true or false', name)
    return value


# OpenAI ------------------------------------------------------------------------------------------


def _openai_read(url: str, body: dict) -> Call:
    """The fields the server itself reads (stream, stream_options' include_usage, n), then the rest."""
    stream = _flag(body, "stream", False)
    if stream and body.get("echo"):  # the echo comes with the record, at the end
        raise JaxinferError('"echo" is not streamed yet: ask without "stream"', "echo")
    options = body.pop("stream_options", None)
    if options is not None and (not isinstance(options, dict) or not stream):
        raise JaxinferError('"stream_options" must be an object, with "stream": true', "stream_options")
    n = body.pop("n", 1)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise JaxinferError(f'"n" must be a whole number from 1 to {MAX_N}', "n")
    usage = bool((options or {}).get("include_usage", False))
    return Call(from_openai(url, body), response_id(url), n, stream, {"usage": usage})


def _openai_whole(url: str, call: Call, records: list[dict]) -> dict:
    return openai_body(records, url, call.model, call.reading)


async def _openai_stream(url: str, call: Call, pieces: AsyncIterator) -> AsyncIterator[str]:
    created, chat = int(time.time()), url == "/v1/chat/completions"

    def chunk(index: int, text: str | None, entries=None, finish=None, calls=None, reasoning=None) -> str:
        return _event(openai_chunk(url, call.id, created, call.model, index, text, entries, finish, calls, reasoning))

    if chat:
        for i in range(call.n):
            yield chunk(i, None)
    records = []
    async for kind, *said in pieces:
        if kind == "failed":
            yield _event({"error": {"message": said[0], "type": "server_error", "param": None, "code": None}})
        elif kind == "piece":
            index, reasoning, content, entries = said
            yield chunk(index, content, entries or None, reasoning=reasoning)
        else:
            index, record, reasoning, content, calls = said
            records.append(record)
            finish = "tool_calls" if calls else finish_reason(record["finish_reason"])
            yield chunk(index, content, finish=finish, calls=calls, reasoning=reasoning)
    if call.extra["usage"] and len(records) == call.n:
        ordered = sorted(records, key=lambda r: r["id"][1])
        yield _event(usage_chunk(url, call.id, created, call.model, ordered))
    yield "data: [DONE]\n\n"


# Anthropic ---------------------------------------------------------------------------------------


def _anthropic_read(url: str, body: dict) -> Call:
    stream = _flag(body, "stream", False)
    item = anthropic.to_item(body)
    return Call(item, anthropic.message_id(), 1, stream, {"stop": list(item.get("stop", []))})


def _anthropic_whole(url: str, call: Call, records: list[dict]) -> dict:
    reply = call.reading.reply(records[0]["text"])
    return anthropic.message_body(records[0], reply, call.model, call.extra["stop"])


def _anthropic_stream(url: str, call: Call, pieces: AsyncIterator) -> AsyncIterator[str]:
    return anthropic.events(pieces, call.id, call.model, call.prompt_tokens, call.extra["stop"])


# OpenAI's Responses -------------------------------------------------------------------------------


def _responses_read(url: str, body: dict) -> Call:
    stream = _flag(body, "stream", False)
    return Call(responses.to_item(body), responses.response_id(), 1, stream, {"created": time.time()})


def _responses_whole(url: str, call: Call, records: list[dict]) -> dict:
    reply = call.reading.reply(records[0]["text"])
    return responses.response_body(call.id, call.model, records[0], reply, call.extra["created"])


def _responses_stream(url: str, call: Call, pieces: AsyncIterator) -> AsyncIterator[str]:
    return responses.events(pieces, call.id, call.model)


# ollama ------------------------------------------------------------------------------------------


def _ollama_read(url: str, body: dict) -> Call:
    stream = _flag(body, "stream", True)  # ollama streams unless told not to
    kind = url.removeprefix("/api/")
    if kind == "generate" and ollama.loads(body):  # a client loading it
        return Call(None, "", answer=ollama.loaded(body, "load"))
    item = ollama.chat_item(body) if kind == "chat" else ollama.generate_item(body)
    return Call(item, f"ollama-{secrets.token_hex(12)}", 1, stream, {"kind": kind})


def _ollama_whole(url: str, call: Call, records: list[dict]) -> dict:
    return ollama.done(call.model, call.extra["kind"], records[0], call.reading.reply(records[0]["text"]), True)


async def _ollama_stream(url: str, call: Call, pieces: AsyncIterator) -> AsyncIterator[str]:
    kind = call.extra["kind"]
    async for event, *said in pieces:
        if event == "failed":
            yield json.dumps({"error": said[0]}) + "\n"
        elif event == "piece":
            _, reasoning, content, _ = said
            yield json.dumps(ollama.chunk(call.model, kind, reasoning, content), ensure_ascii=False) + "\n"
        else:
            _, record, reasoning, content, calls = said
            line = ollama.done(call.model, kind, record, (reasoning, content, calls), False)
            yield json.dumps(line, ensure_ascii=False) + "\n"


def _ollama_error(message: str, status: int) -> dict:
    return {"error": message}


# llama-server's own ---------------------------------------------------------------------------------


def _llama_read(url: str, body: dict) -> Call:
    stream = _flag(body, "stream", False)
    return Call(utilities.completion_item(url, body), f"cmpl-{secrets.token_hex(12)}", 1, stream)


def _llama_whole(url: str, call: Call, records: list[dict]) -> dict:
    return utilities.completion_body(records[0], call.model)


async def _llama_stream(url: str, call: Call, pieces: AsyncIterator) -> AsyncIterator[str]:
    async for kind, *said in pieces:
        if kind == "failed":
            yield _event({"error": {"message": said[0], "type": "server_error", "code": said[1]}})
        elif kind == "piece":
            yield _event({"content": said[2], "stop": False})
        else:
            yield _event(utilities.completion_body(said[1], call.model, said[3]))


def _llama_error(message: str, status: int) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"code": status, "message": message, "type": kind}}


OPENAI = Protocol(_openai_read, _openai_whole, _openai_stream)
ANTHROPIC = Protocol(_anthropic_read, _anthropic_whole, _anthropic_stream, anthropic.error_body)
RESPONSES = Protocol(_responses_read, _responses_whole, _responses_stream)
OLLAMA = Protocol(_ollama_read, _ollama_whole, _ollama_stream, _ollama_error, "application/x-ndjson")
LLAMA = Protocol(_llama_read, _llama_whole, _llama_stream, _llama_error)
PROTOCOLS = {
    "/v1/chat/completions": OPENAI,
    "/v1/completions": OPENAI,
    "/v1/responses": RESPONSES,
    "/v1/messages": ANTHROPIC,
    "/api/chat": OLLAMA,
    "/api/generate": OLLAMA,
    "/completion": LLAMA,
    "/infill": LLAMA,
}
