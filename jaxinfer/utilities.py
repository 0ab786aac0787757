"""llama-server's utility endpoints, which editors and tools call beside the chat: `/tokenize`,
`/detokenize`, `/apply-template` (the prompt a conversation renders to, as the chat endpoint renders
it: `api.Parser.chat_prompt`) and `/props` (the model, its context, slots, template and default
sampling). Each takes the request body (none for /props) and gives the answer's body; a bad body
is one JaxinferError."""

from __future__ import annotations

from jaxinfer.api import Parser, boolean
from jaxinfer.errors import JaxinferError


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
