"""What a request may say, and what its result looks like, for every driver that takes requests as
data: `jaxinfer batch` lines and `jaxinfer serve` bodies both go through `Parser.parse` (one set of
defaults, one set of errors), in our own shape or OpenAI's (`from_openai`), and results leave in
OpenAI's shapes (`openai_body`, `openai_chunk`).

Our shape: {"prompt": "..."} or {"messages": [...]} (rendered with the model's chat template; a
message's content a string or OpenAI's text parts), with optional max_tokens, temperature, top_p,
top_k, min_p, repeat_penalty, seed, stop, ignore_eos, speculate (false: this request does not
draft, where the runner speculates), logprobs (N: each token's log-probability and the N most
likely alternatives, 0 to 20) and a constraint (OpenAI's response_format, vLLM's guided_json /
guided_regex / guided_choice / guided_grammar: `jaxinfer.constrain`). Unknown fields are refused:
a misspelt one would silently change nothing.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace

from jaxinfer import defaults, infill
from jaxinfer.buckets import check_fits, check_text_fits
from jaxinfer.chat_template import ChatOptions, ChatTemplate, check_kwargs
from jaxinfer.constrain import FIELDS as CONSTRAINT_FIELDS
from jaxinfer.constrain import Constraint, check_one_process, from_request
from jaxinfer.errors import JaxinferError, boolean, refuse_unknown
from jaxinfer.loading import LoadedModel
from jaxinfer.matchers import check_for
from jaxinfer.processes import shared_seed
from jaxinfer.replies import Reading, Thinking, bounded
from jaxinfer.sampling import check_logprobs
from jaxinfer.scheduler import Request
from jaxinfer.slots import penalized
from jaxinfer.text import check_stops
from jaxinfer.tools import check_tools, forced_grammar, format_of, template_messages

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
FIELDS = {
    "prompt",
    "messages",
    "max_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "speculate",
    "logprobs",
    "echo",
    "logit_bias",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "reasoning_format",
    "thinking_budget_tokens",  # llama-server's: a thinking block closed after this many tokens
    "min_tokens",  # vLLM's: no EOS before this many tokens
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "suffix",  # fill-in-the-middle (`jaxinfer.infill`): the code after the gap `prompt` is before
    "input_extra",  # and other files, as llama-server's /infill takes them
    *CONSTRAINT_FIELDS,
    *SAMPLING_FIELDS,
}

# OpenAI's endpoints: each decides prompt or messages, and the shape of its result. vLLM's
# extensions (top_k, min_p, repetition_penalty, guided_*) are read as well.
ENDPOINTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
RENAMED = {"max_completion_tokens": "max_tokens", "repetition_penalty": "repeat_penalty"}
# The fields clients send beyond those read above (docs/server.md has this table). Accepted where
# they change nothing here (None: any value; else only these values, others refused): "model" names
# the model asked for (the result says the one that ran); `verbosity` (GPT-5's answer length) no
# model here reads; `prediction` (predicted output) only makes OpenAI's answer faster; the text
# modality is the only one. A driver reads the fields it handles itself (the server's stream,
# stream_options, n) before these.
ACCEPTED = {
    "model": None,
    "user": None,
    "metadata": None,
    "store": None,
    "service_tier": None,
    "parallel_tool_calls": None,
    "verbosity": None,
    "prediction": None,
    "modalities": (["text"],),
    "skip_special_tokens": (True,),
    "n": (1,),
    "stream": (False,),
    "stream_options": (None,),
}
# Refused: what they ask for is not done here, and answering without it would mislead.
REFUSED = {
    "web_search_options": "searching the web is not offered: the model answers from what it knows",
    "audio": "audio output is not offered: the models here write text",
}


class Parser:
    """Requests for one model and context. `max_tokens`: the budget where a request gives none;
    None: the model's default (generation_config.json's, else `defaults.MAX_TOKENS`), which shrinks
    to the room a prompt leaves, as `run`'s does. A budget given that the context cannot hold after
    the prompt is refused, never clipped: the caller asked for it. `speculating`: the runner drafts.
    `chat`: the chat template's variables and the reading of replies where a request says none."""

    def __init__(
        self,
        model: LoadedModel,
        context: int,
        max_tokens: int | None = None,
        speculating: bool = False,
        chat: ChatOptions = ChatOptions(),
    ):
        self.model, self.context, self.max_tokens, self.speculating = model, context, max_tokens, speculating
        self.chat = chat
        self._template: ChatTemplate | None = None

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.of(self.model)
        return self._template

    def parse(self, request_id, item: dict) -> Request:
        """The request `item` (our shape) asks for; a JaxinferError says what is wrong with it. A
        field given as null is not given (OpenAI's reading: wrappers forward unset options as None)."""
        item = {k: v for k, v in item.items() if v is not None}
        refuse_unknown(item, FIELDS)
        self.model.check_generates()
        tokenizer = self.model.tokenizer
        if ("prompt" in item) == ("messages" in item):
            raise JaxinferError('a request needs exactly one of "prompt" and "messages"')
        (tools, forced), reading, thinking = check_tools(item.get("tools"), item.get("tool_choice")), None, None
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not (item["prompt"] or "suffix" in item):
                raise JaxinferError('"prompt" must be a non-empty string')  # before a suffix it may be empty
            if tools:
                raise JaxinferError('"tools" go with "messages": the chat template offers them to the model', "tools")
            for name in (
                "reasoning_effort",
                "reasoning_format",
                "thinking_budget_tokens",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
            ):
                if name in item:
                    raise JaxinferError(f'"{name}" goes with "messages": it is the chat template\'s', name)
            if "suffix" in item or "input_extra" in item:
                ids = self._infill(item)
            else:
                check_text_fits(item["prompt"], tokenizer, self.context)
                ids = tokenizer.encode(item["prompt"])
        elif "suffix" in item or "input_extra" in item:
            raise JaxinferError('"suffix" goes with "prompt": the code before and after the gap to fill', "suffix")
        else:
            text, reading, thinking = self.chat_prompt(item, tools, forced)
            check_text_fits(text, tokenizer, self.context)
            ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = _whole(item, "max_tokens", self.max_tokens) if "max_tokens" in item else self.max_tokens
        if max_tokens is None:  # the default shrinks to fit, as run's
            default = self.model.max_new_tokens or defaults.MAX_TOKENS
            max_tokens = max(1, min(default, self.context - len(ids)))
        seed = _whole(item, "seed", shared_seed(), minimum=None)
        check_fits(len(ids), max_tokens, self.context)
        min_tokens = _whole(item, "min_tokens", 0, minimum=0)
        if min_tokens > max_tokens:
            raise JaxinferError(f'"min_tokens" ({min_tokens}) must not pass "max_tokens" ({max_tokens})', "min_tokens")
        given = {k: item[k] for k in SAMPLING_FIELDS if k in item}
        for name, value in given.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise JaxinferError(f'"{name}" must be a number')
        sampling = replace(self.model.sampling, **given)
        stop = item.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise JaxinferError('"stop" must be a string or a list of strings')
        stop = check_stops(stop) + (self.template.stop if "messages" in item else ())
        ignore_eos = boolean(item, "ignore_eos", False)
        speculate = boolean(item, "speculate", self.speculating)
        if speculate and not self.speculating:
            raise JaxinferError('"speculate": true needs a runner that speculates (ngram or a draft model)')
        logprobs = item.get("logprobs")
        check_logprobs(logprobs)
        echo = boolean(item, "echo", False)
        if echo and "prompt" not in item:
            raise JaxinferError('"echo" gives back a prompt: it is for the completions endpoint\'s "prompt"', "echo")
        constraint = from_request(item)
        if forced:  # a call the model must make: its grammar, as any constraint
            if constraint is not None:
                raise JaxinferError(
                    'a forced tool call ("tool_choice") and an output constraint cannot both hold', "tool_choice"
                )
            constraint = Constraint("grammar", forced_grammar(forced, reading.calls))
        if constraint is not None:  # refused here, not at admission: a row that cannot start would end the job
            check_one_process()
            check_for(constraint, tokenizer, self.model.config.sampled_ids, self.model.eos_ids)
        logit_bias = self._logit_bias(item.get("logit_bias"))
        # a penalized or guarded row drafts nothing
        speculate &= not logit_bias and not penalized(sampling) and not min_tokens and thinking is None
        return Request(
            request_id,
            ids,
            sampling,
            max_tokens,
            seed,
            stop,
            ignore_eos,
            speculate,
            logprobs,
            constraint,
            logit_bias=logit_bias,
            min_tokens=min_tokens,
            thinking=thinking,
            reading=reading,
            echo=item["prompt"] if echo else None,
        )

    def _infill(self, item: dict) -> list[int]:
        """A fill-in-the-middle prompt's ids (`jaxinfer.infill`): the code before the gap (`prompt`),
        after it (`suffix`) and other files (`input_extra`), cut to leave the middle its tokens (those
        asked for, else a quarter of the context). Each text is cut to what the context could hold
        before it is tokenized: the prefix's end, the suffix's beginning."""
        suffix = item.get("suffix", "")
        if not isinstance(suffix, str):
            raise JaxinferError('"suffix" must be a string: the code after the gap', "suffix")
        files = infill.check_files(item.get("input_extra", []))
        most = self.context * self.model.tokenizer.max_piece_chars
        asked = item.get("max_tokens")
        room = self.context - (asked if isinstance(asked, int) and 0 < asked < self.context else self.context // 4)
        return infill.prompt_ids(self.model.tokenizer, item["prompt"][-most:], suffix[:most], files, room)

    def chat_prompt(
        self, item: dict, tools: list[dict] | None = None, forced=None
    ) -> tuple[str, Reading, Thinking | None]:
        """A chat request's conversation rendered by the template (with `tools` offered, where a call
        is `forced` or not), how its reply reads (`ChatTemplate.prompt`), and the bound its reasoning
        budget sets (`replies.bounded`)."""
        found = format_of(self.template.source)
        if tools and found is None:
            raise JaxinferError("this model's chat template offers no tools (in a format parsed here)", "tools")
        if forced and found == "harmony":
            raise JaxinferError(
                'a forced tool call is not offered in harmony\'s format (gpt-oss): "tool_choice": "auto" lets '
                "the model call",
                "tool_choice",
            )
        chat = self.chat
        if "chat_template_kwargs" in item or "reasoning_format" in item:
            kwargs = {**chat.kwargs, **check_kwargs(item.get("chat_template_kwargs", {}))}
            chat = replace(chat, kwargs=kwargs, reasoning_format=item.get("reasoning_format", chat.reasoning_format))
        if "thinking_budget_tokens" in item:
            chat = replace(chat, reasoning_budget=_whole(item, "thinking_budget_tokens", -1, minimum=-1))
        text, reading = self.template.prompt(
            template_messages(_messages(item.get("messages"))),
            chat,
            calls=found if tools or found == "harmony" else None,  # harmony: the reasoning read apart
            tools=tools,
            continue_final=boolean(item, "continue_final_message", False),
            add_generation_prompt=boolean(item, "add_generation_prompt", not item.get("continue_final_message")),
            **self.template.reasoning(item.get("reasoning_effort"), strict=False),
        )
        budget, message = chat.reasoning_budget, chat.reasoning_budget_message
        return text, reading, bounded(budget, self.template.source, reading.opened, self.model.tokenizer, message)

    def _logit_bias(self, given) -> dict[int, float] | None:
        """OpenAI's logit_bias: {token id (as a string): a bias from -100 (banned) to 100 (forced)}."""
        if given is None or given == {}:
            return None
        vocab = self.model.config.sampled_ids
        if not isinstance(given, dict):
            raise JaxinferError('"logit_bias" must map token ids to biases from -100 to 100', "logit_bias")
        bias = {}
        for key, value in given.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
            if token is None or not 0 <= token < vocab:
                raise JaxinferError(
                    f'"logit_bias": {key!r} is not a token id of this model (0 to {vocab - 1})', "logit_bias"
                )
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
                raise JaxinferError(f'"logit_bias": the bias of {key} must be a number from -100 to 100', "logit_bias")
            bias[token] = float(value)
        return bias


def _messages(messages) -> list[dict]:
    """Chat messages for the template: each {"role", "content"}, the content a string or a list of
    OpenAI's text parts ({"type": "text", "text": ...}, joined); other parts (images, audio) are
    refused, since the model reads text only."""
    if not isinstance(messages, list) or not messages:
        raise JaxinferError('"messages" must be a non-empty list of {"role", "content"} objects')
    rendered = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or "content" not in m
            and "tool_calls" not in m
        ):
            raise JaxinferError('"messages" must be a non-empty list of {"role", "content"} objects')
        content = m.get("content")
        if content is None and m.get("tool_calls"):  # an assistant's turn that only called tools
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - {"text"})
                raise JaxinferError(
                    'a message\'s content parts must be text ({"type": "text", "text": ...})'
                    + (f"; this model reads no {', '.join(kinds)}" if kinds else "")
                )
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise JaxinferError("a message's content must be a string or a list of text parts")
        rendered.append({**m, "content": content})
    return rendered


def _whole(item: dict, name: str, default: int, minimum: int | None = 1) -> int:
    value = item.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise JaxinferError(f'"{name}" must be a whole number' + (f" ≥ {minimum}" if minimum is not None else ""))
    return value


def from_openai(url: str, body: dict) -> dict:
    """An OpenAI request body for `url` (one of ENDPOINTS) as our request fields; the API's fields
    that change nothing here are accepted and dropped (`ACCEPTED`), the rest refused."""
    if not isinstance(body, dict):
        raise JaxinferError("the request body must be a JSON object")
    body, item = {k: v for k, v in body.items() if v is not None}, {}  # null: not given
    if url == "/v1/chat/completions":  # logprobs: true, top_logprobs: N (the completions endpoint: logprobs: N)
        asked, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
        if asked not in (None, True, False):
            raise JaxinferError('"logprobs" must be true or false')
        if top and not asked:  # 0, the API's default, changes nothing
            raise JaxinferError('"top_logprobs" needs "logprobs": true')
        if asked:
            item["logprobs"] = 0 if top is None else top
    elif body.get("logprobs") is False or body.get("logprobs") is None:  # N or null; false is read as off
        body.pop("logprobs", None)
    _legacy_functions(body)
    for name, value in body.items():
        if name in REFUSED:
            raise JaxinferError(f'"{name}": {REFUSED[name]}', name)
        if name in ACCEPTED:
            neutral = ACCEPTED[name]
            if neutral is not None and value is not None and value not in neutral:
                said = " or ".join(json.dumps(v) for v in neutral)
                raise JaxinferError(f'"{name}": only {said} is supported (any other value would change the answer)')
        elif name in ("prompt", "messages") and name != ENDPOINTS[url]:
            raise JaxinferError(f'{url} takes "{ENDPOINTS[url]}", not "{name}"')
        else:
            item[RENAMED.get(name, name)] = value
    return item


def _legacy_functions(body: dict) -> None:
    """OpenAI's deprecated `functions` / `function_call` as today's `tools` / `tool_choice` (the reply
    says its calls as `tool_calls`), in place."""
    if "functions" in body:
        if "tools" in body:
            raise JaxinferError('"functions" is the older name of "tools": give one of them', "functions")
        functions = body.pop("functions")
        body["tools"] = (
            [{"type": "function", "function": f} for f in functions] if isinstance(functions, list) else functions
        )
    if "function_call" in body:
        if "tool_choice" in body:
            raise JaxinferError('"function_call" is the older name of "tool_choice": give one of them', "function_call")
        call = body.pop("function_call")
        named = isinstance(call, dict) and "name" in call
        body["tool_choice"] = {"type": "function", "function": {"name": call["name"]}} if named else call


def _completions_logprobs(entries: list[dict]) -> dict:
    """Our logprob entries in the completions endpoint's (legacy) shape."""
    offsets = [0]
    for e in entries[:-1]:
        offsets.append(offsets[-1] + len(e["token"]))
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def _logprobs(url: str, entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None
    return {"content": entries, "refusal": None} if url == "/v1/chat/completions" else _completions_logprobs(entries)


def finish_reason(ours: str) -> str:
    """Our finish reason in OpenAI's words: "length" for an answer cut short (its budget spent, a
    constrained answer unfinished, or cancelled), "stop" for one that ended (EOS, a stop string, a
    constraint's match complete)."""
    return "length" if ours in ("length", "unfinished", "cancelled") else "stop"


def response_id(url: str) -> str:
    return f"{'chatcmpl' if url == '/v1/chat/completions' else 'cmpl'}-{secrets.token_hex(12)}"


def usage(records: list[dict]) -> dict:
    """The `usage` of a request's choices (`Scheduler` records): one prompt, every choice's tokens."""
    prompt, completion = records[0]["prompt_tokens"], sum(r["generated_tokens"] for r in records)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": records[0].get("cached_tokens", 0)},
    }


def openai_body(records: list[dict], url: str, model: str, reading: Reading | None = None) -> dict:
    """Result records (`Scheduler`'s, one per choice) as the endpoint's response body; `reading`: how
    a chat reply reads into reasoning, content and tool calls."""
    chat = url == "/v1/chat/completions"

    def choice(index: int, record: dict) -> dict:
        finish = finish_reason(record["finish_reason"])
        if not chat:  # echo: the prompt before the text, its tokens' log-probabilities before theirs
            entries = record.get("logprobs")
            entries = None if entries is None else record.get("prompt_logprobs", []) + entries
            text = record.get("prompt", "") + record["text"]
            return {"index": index, "text": text, "logprobs": _logprobs(url, entries), "finish_reason": finish}
        logprobs = _logprobs(url, record.get("logprobs"))
        reasoning, content, calls = (reading or Reading()).reply(record["text"])
        message = {"role": "assistant", "content": content}
        message |= ({"reasoning_content": reasoning} if reasoning else {}) | ({"tool_calls": calls} if calls else {})
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls else finish,
        }

    first = records[0]
    return {
        "id": response_id(url),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice(i, r) for i, r in enumerate(records)],
        "usage": usage(records),
        "jaxinfer": {"finish_reason": first["finish_reason"], "seed": first["seed"], "timings": first["timings"]}
        if len(records) == 1
        else {
            "choices": [
                {"finish_reason": r["finish_reason"], "seed": r["seed"], "timings": r["timings"]} for r in records
            ]
        },
    }


def openai_chunk(
    url: str,
    response: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    logprobs: list[dict] | None = None,
    finish: str | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
) -> dict:
    """One streamed chunk of choice `index`: new text (the chat endpoint's first chunk, text None,
    says the role), the log-probabilities of its tokens where asked for, the finish reason at the
    end; a chat's new reasoning (`reasoning_content`) and its `tool_calls` (`tools.reply`'s) whole, in
    one chunk."""
    if url == "/v1/chat/completions":
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        said, kind = {"delta": delta}, "chat.completion.chunk"
    else:
        said, kind = {"text": text or ""}, "text_completion"
    choice = {"index": index, **said, "logprobs": _logprobs(url, logprobs), "finish_reason": finish}
    return {"id": response, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(url: str, response: str, created: int, model: str, records: list[dict]) -> dict:
    """The last streamed chunk where `stream_options` asks for it: no choices, the request's `usage`."""
    chunk = openai_chunk(url, response, created, model, 0, "")
    return chunk | {"choices": [], "usage": usage(records)}
