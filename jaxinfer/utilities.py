"""llama-server's own endpoints, which editors and tools call beside the chat: `/tokenize`,
`/detokenize`, `/apply-template` (the prompt a conversation renders to, as the chat endpoint renders
it: `api.Parser.chat_prompt`) and `/props` (the model, its context, slots, template and default
sampling), each taking the request body (none for /props) and giving the answer's body; and the
shapes of its `/completion` and `/infill` (llama.vscode's fill-in-the-middle: `jaxinfer.infill`),
which `protocols.LLAMA` serves. A bad body is one JaxinferError."""

from __future__ import annotations

from jaxinfer.api import SAMPLING_FIELDS, Parser
from jaxinfer.errors import JaxinferError, boolean, refuse_unknown


def tokenize(parser: Parser, body: dict) -> dict:
    """{"content", "add_special"?, "with_pieces"?} → {"tokens": ids, or [{"id", "piece"}]}: a piece is
    its text, or its bytes where they are not whole UTF-8 (as llama-server gives them)."""
    content = body.get("content")
    if not isinstance(content, str):
        raise JaxinferError('"content" must be the text to tokenize')
    tokenizer = parser.model.tokenizer
    ids = tokenizer.encode(content, add_special_tokens=boolean(body, "add_special", False))
    if not boolean(body, "with_pieces", False):
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": _piece(tokenizer.token_bytes(i))} for i in ids]}


def detokenize(parser: Parser, body: dict) -> dict:
    """{"tokens": ids} → {"content": their text}."""
    ids, vocab = body.get("tokens"), parser.model.tokenizer.vocab_size
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise JaxinferError('"tokens" must be a list of token ids')
    if any(not 0 <= i < vocab for i in ids):
        raise JaxinferError(f'"tokens": a token id is not one of this model\'s (0 to {vocab - 1})')
    return {"content": parser.model.tokenizer.decode(ids)}


def apply_template(parser: Parser, body: dict) -> dict:
    """{"messages", and the chat request's template fields} → {"prompt": the text the model reads}."""
    from jaxinfer.tools import check_tools

    tools, _ = check_tools(body.get("tools"), None)
    return {"prompt": parser.chat_prompt(body, tools)[0]}


def props(parser: Parser, slots: int) -> dict:
    model, sampling = parser.model, parser.model.sampling
    return {
        "model_path": str(model.path),
        "total_slots": slots,
        "chat_template": model.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "default_generation_settings": {
            "n_ctx": parser.context,
            "params": {
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": sampling.min_p,
                "repeat_penalty": sampling.repeat_penalty,
                "n_predict": parser.max_tokens or -1,
            },
        },
    }


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


# llama-server's /completion and /infill: its fields → ours (the sampling ones by the same names)
COMPLETION = {"prompt": "prompt", "n_predict": "max_tokens", "seed": "seed", "stop": "stop"}
COMPLETION |= {name: name for name in SAMPLING_FIELDS}
INFILL = {"input_prefix": "prompt", "input_suffix": "suffix", "input_extra": "input_extra"}
# what llama.vscode and llama-server's own page send that changes nothing here: its cache reuse
# (done here anyway), its sampler order and time limits, which fields to answer with
IGNORED = {"cache_prompt", "samplers", "n_indent", "t_max_prompt_ms", "t_max_predict_ms", "response_fields"}
IGNORED |= {"id_slot", "model", "n_keep", "stream"}


def completion_item(url: str, body: dict) -> dict:
    """A /completion or /infill body as our request fields; /infill's `prompt` is the text typed at
    the gap, which follows `input_prefix` (as llama-server puts its tokens after the prefix's)."""
    body = {k: v for k, v in body.items() if v is not None and k not in IGNORED}
    fields = COMPLETION | (INFILL if url == "/infill" else {})
    refuse_unknown(body, set(fields))
    item = {ours: body[theirs] for theirs, ours in fields.items() if theirs in body and ours != "prompt"}
    if item.get("max_tokens") == -1:  # llama-server's "until the end"
        del item["max_tokens"]
    if url == "/completion":
        return item | {"prompt": body.get("prompt", "")}
    prefix, typed = body.get("input_prefix", ""), body.get("prompt", "")
    if not isinstance(prefix, str) or not isinstance(typed, str):
        raise JaxinferError('"input_prefix" and "prompt" must be text', "input_prefix")
    return item | {"prompt": prefix + typed, "suffix": item.get("suffix", "")}


def completion_body(record: dict, model: str, content: str | None = None) -> dict:
    """llama-server's answer (the whole, or a stream's last event with `content` what it adds)."""
    timings, reason = record.get("timings", {}), record["finish_reason"]
    ttft, total = timings.get("ttft_s", 0.0), timings.get("total_s", 0.0)
    generated = record["generated_tokens"]
    return {
        "content": record["text"] if content is None else content,
        "stop": True,
        "model": model,
        "tokens_predicted": generated,
        "tokens_evaluated": record["prompt_tokens"],
        "tokens_cached": record["cached_tokens"],
        "truncated": False,
        "stop_type": {"eos": "eos", "stop": "word"}.get(reason, "limit"),
        "stopping_word": record.get("stop_string", ""),
        "timings": {
            "prompt_n": record["prompt_tokens"] - record["cached_tokens"],
            "prompt_ms": round(1000 * ttft, 3),
            "predicted_n": generated,
            "predicted_ms": round(1000 * max(0.0, total - ttft), 3),
            "predicted_per_second": timings.get("decode_tok_s", 0.0),
        },
    }
