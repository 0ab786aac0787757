"""ollama's API, which GitHub Copilot's bring-your-own-model option, Open WebUI and the `ollama`
clients speak: `/api/chat` and `/api/generate` (newline-delimited JSON streams, streamed unless
`"stream": false`), `/api/tags`, `/api/show` (with the model's capabilities), `/api/ps`,
`/api/version` and `/api/embed` (with the older `/api/embeddings`). A request is read into our own
shape (the one parser and scheduler every driver uses); its result is written back in ollama's
shapes. The server (`jaxinfer.server`) moves the bytes.

Read: `messages` (content, `tool_calls` with arguments as objects, a tool turn's `tool_name`; an
earlier turn's `thinking` dropped, as the templates drop earlier reasoning), `prompt` and `system`
(generate: rendered through the chat template as one turn, or as it is with `raw`), `tools`,
`format` ("json" or a JSON schema: the answer decoded to match it), `think` (false turns a thinking
model's thinking off; "low", "medium", "high" its template's effort) and `options` (`OPTIONS`;
the runner's own settings, such as `num_ctx` or `num_thread`, are accepted and change nothing:
the server's flags set them). `model` and `keep_alive` are the router's (`jaxinfer.router`).
`suffix` makes a generate request fill in the middle between `prompt` and it (`jaxinfer.infill`).
Images, `template` and `context` are refused in one line.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from jaxinfer.errors import JaxinferError, boolean

# the ollama API these endpoints follow: clients check it (Copilot asks for a recent one)
VERSION = "0.13.0"
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
}
# the runner's own settings: the server's flags set them (-c, -b, -t), a request cannot
RUNNER = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "num_keep")
RUNNER += ("low_vram", "vocab_only", "repeat_last_n")
IGNORED = ("model", "keep_alive")


def chat_item(body: dict) -> dict:
    """An /api/chat body as our request fields."""
    body = _known(body, {"messages", "tools", "format", "options", "think"})
    item = {"messages": [_message(m) for m in _list(body.get("messages"), "messages")]}
    if body.get("tools"):
        item["tools"] = body["tools"]  # OpenAI's function definitions, as ollama takes them
    return item | _common(body)


def generate_item(body: dict) -> dict:
    """An /api/generate body as our request fields: the prompt through the chat template as one turn
    (with its `system`), as it is (`raw`), or before the gap to fill where a `suffix` follows it."""
    body = _known(body, {"prompt", "system", "raw", "format", "options", "think", "suffix", "images"})
    if body.get("images"):
        raise JaxinferError('"images" is not offered here (the model reads text only)')
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise JaxinferError('"prompt" must be text')
    if "suffix" in body:  # fill-in-the-middle: the code before and after the gap, not a chat turn
        return {"prompt": prompt, "suffix": body["suffix"]} | _common(body, chat=False)
    if body.get("raw"):
        return {"prompt": prompt} | _common(body, chat=False)
    turns = [{"role": "system", "content": body["system"]}] if body.get("system") else []
    return {"messages": turns + [{"role": "user", "content": prompt}]} | _common(body)


def chunk(model: str, kind: str, reasoning: str, content: str) -> dict:
    """One streamed line of what is new."""
    said = {"content": content} | ({"thinking": reasoning} if reasoning else {})
    body = {"message": {"role": "assistant", **said}} if kind == "chat" else {"response": content} | _thought(said)
    return {"model": model, "created_at": now(), **body, "done": False}


def done(model: str, kind: str, record: dict, reply: tuple, whole: bool) -> dict:
    """The last line (or, not streamed, the whole answer): `reply` is (reasoning, content, calls),
    whole or what the end lets through."""
    reasoning, content, calls = reply
    said = {"content": content or ""} | ({"thinking": reasoning} if reasoning else {})
    if calls:
        said["tool_calls"] = [
            {"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls
        ]
    body = {"message": {"role": "assistant", **said}} if kind == "chat" else {"response": said["content"]}
    if kind != "chat":
        body |= _thought(said)
    timings = record.get("timings", {})
    total, ttft = timings.get("total_s", 0.0), timings.get("ttft_s", 0.0)
    return {
        "model": model,
        "created_at": now(),
        **body,
        "done": True,
        "done_reason": "length" if record["finish_reason"] in ("length", "unfinished", "cancelled") else "stop",
        "total_duration": _ns(timings.get("queued_s", 0.0) + total),
        "load_duration": 0,
        "prompt_eval_count": record["prompt_tokens"],
        "prompt_eval_duration": _ns(ttft),
        "eval_count": record["generated_tokens"],
        "eval_duration": _ns(max(0.0, total - ttft)),
    }


def embed_request(body: dict, legacy: bool = False):
    """An /api/embed body (`input`: a text or texts; `truncate`, on unless false; `dimensions`), or
    the older /api/embeddings' (`prompt`), as an embedding request (`embeddings.Asked`)."""
    from jaxinfer.embeddings import Asked, dimensions_of, inputs_of

    if legacy:
        body = _known(body, {"prompt", "options"})
        if not isinstance(body.get("prompt"), str):
            raise JaxinferError('"prompt" must be the text to embed', "prompt")
        return Asked([body["prompt"]], truncate=True)
    body = _known(body, {"input", "truncate", "dimensions", "options"})
    return Asked(inputs_of(body.get("input")), dimensions_of(body), boolean(body, "truncate", True))


def embed_answer(name: str, vectors, tokens: int, seconds: float, legacy: bool = False) -> dict:
    if legacy:
        return {"embedding": vectors[0].tolist()}
    return {
        "model": name,
        "embeddings": vectors.tolist(),
        "total_duration": _ns(seconds),
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


def details(model) -> dict:
    """A loaded model (`loading.LoadedModel`) as /api/tags and /api/show describe one."""
    from jaxinfer.roofline import parameter_count

    count = parameter_count(model.config)
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return {
        "format": "gguf" if str(model.path).endswith(".gguf") else "safetensors",
        "family": model.config.architecture,
        "parameter_size": size,
        "quantization_level": model.methods or model.dtype,
    }


def show(model, name: str, context: int) -> dict:
    """/api/show: the template, details and capabilities a client decides on (Copilot offers a model
    for agent mode where it says "tools")."""
    from jaxinfer.replies import think_markers
    from jaxinfer.tools import format_of

    template = model.chat_template or ""
    capabilities = ["completion"] + ["tools"] * bool(format_of(template))
    capabilities += ["thinking"] * bool(think_markers(template) or "<|channel|>" in template)
    if model.config.headless:  # an embedding model: that is all it does
        capabilities = ["embedding"]
    return {
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": details(model),
        "model_info": {"general.architecture": model.config.architecture, f"{name}.context_length": context},
        "capabilities": capabilities,
        "modified_at": now(),
    }


def listed(model, name: str) -> dict:
    """One model of /api/tags and /api/ps."""
    size = sum(f.stat().st_size for f in model.path.glob("*") if f.is_file()) if model.path.is_dir() else 0
    return {"name": name, "model": name, "modified_at": now(), "size": size, "digest": "", "details": details(model)}


def _common(body: dict, chat: bool = True) -> dict:
    """`options`, `format` and `think` as our fields."""
    item = {}
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise JaxinferError('"options" must be an object')
    unknown = sorted(set(options) - set(OPTIONS) - set(RUNNER))
    if unknown:
        raise JaxinferError(f"unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}")
    item |= {OPTIONS[k]: v for k, v in options.items() if k in OPTIONS and v is not None}
    given = body.get("format")
    if given == "json":
        item["response_format"] = {"type": "json_object"}
    elif isinstance(given, dict):
        item["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": given}}
    elif given not in (None, ""):
        raise JaxinferError('"format" must be "json" or a JSON schema')
    think = body.get("think")
    if think is not None and chat:
        if think is False:
            item["chat_template_kwargs"] = {"enable_thinking": False}
        elif think in ("low", "medium", "high"):
            item["reasoning_effort"] = think
        elif think is not True:
            raise JaxinferError('"think" must be true, false, "low", "medium" or "high"')
    return item


def _message(m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), str):
        raise JaxinferError('"messages" must be a list of {"role", "content"} objects with text content')
    if m.get("images"):
        raise JaxinferError("a message's images are not taken here: the model reads text only")
    out = {"role": m["role"], "content": m.get("content", "")}
    if m.get("tool_calls"):
        calls = _list(m["tool_calls"], "tool_calls")
        out["tool_calls"] = [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": json.dumps((c.get("function") or {}).get("arguments", {}), ensure_ascii=False),
                },
            }
            for k, c in enumerate(calls)
            if isinstance(c, dict)
        ]
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    return out


def loads(body: dict) -> bool:
    """A generate request that asks for nothing but the model (held, or with `keep_alive` 0 stopped)."""
    return not any(body.get(k) for k in ("prompt", "system", "suffix"))


def loaded(body: dict, reason: str) -> dict:
    """The answer to such a request: `reason` "load" or "unload"."""
    return {"model": body.get("model", ""), "created_at": now(), "response": "", "done": True, "done_reason": reason}


def keep_alive(value) -> float | None:
    """ollama's `keep_alive` (and `serve --keep-alive`): how long a model stays held after its last
    request, in seconds; None: for ever (a negative value). Seconds as a number, or a duration of
    Go's kind ("5m", "1h30m", "90s", "0")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and re.fullmatch(r"-?(\d+(\.\d+)?(ms|s|m|h)?)+", value.strip()):
        sign = -1 if value.strip().startswith("-") else 1
        units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "": 1}
        parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", value)
        seconds = sign * sum(float(n) * units[u] for n, u in parts)
    else:
        raise JaxinferError(
            '"keep_alive" must be seconds or a duration such as "5m" (negative: for ever)', "keep_alive"
        )
    return None if seconds < 0 else seconds


def _known(body: dict, fields: set[str]) -> dict:
    body = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise JaxinferError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}")
    return body


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise JaxinferError(f'"{where}" must be a list')
    return value


def _thought(said: dict) -> dict:
    return {"thinking": said["thinking"]} if "thinking" in said else {}


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
