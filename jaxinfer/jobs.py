"""Batch jobs: JSONL requests in, JSONL records out, each written and flushed as it is made.

An input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} (rendered with the
model's chat template), with optional max_tokens, temperature, top_p, top_k, min_p, repeat_penalty,
seed, stop, ignore_eos, speculate (false: this request does not draft, in a job run with --speculate
or --draft-model), logprobs (N: each token's log-probability and the N most likely alternatives,
0 to 20) and a constraint (OpenAI's response_format, vLLM's guided_json / guided_regex /
guided_choice / guided_grammar: `jaxinfer.constrain`); "custom_id" is accepted for "id". A line in
the OpenAI Batch API shape ({"custom_id", "method", "url", "body"}) gets its result in that API's
output shape. A bad line, unknown fields
included, becomes an error record in the output and the job goes on. The output is locked while a job
writes it. On resume, ids already in the output are skipped (and bad lines already recorded), and a last
record cut short by a kill is removed first, so every id ends up there exactly once.
"""

from __future__ import annotations

import fcntl
import io
import json
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, TextIO

from jaxinfer import defaults
from jaxinfer.batch import Request
from jaxinfer.chat_template import ChatTemplate
from jaxinfer.constrain import FIELDS as CONSTRAINT_FIELDS
from jaxinfer.constrain import check_for, from_request
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.processes import shared_seed
from jaxinfer.sampling import check_logprobs
from jaxinfer.sharding import mesh_of
from jaxinfer.slots import check_fits, check_text_fits

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
FIELDS = {
    "id",
    "custom_id",
    "prompt",
    "messages",
    "max_tokens",
    "seed",
    "stop",
    "ignore_eos",
    "speculate",
    "logprobs",
    *CONSTRAINT_FIELDS,
    *SAMPLING_FIELDS,
}

# OpenAI Batch API lines (also vLLM's run-batch): the endpoint decides prompt or messages, and the
# result is written in its output shape. vLLM's extensions (top_k, min_p, ...) are read as well.
OPENAI_ENDPOINTS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
OPENAI_LINE = {"custom_id", "method", "url", "body"}
OPENAI_RENAMED = {"max_completion_tokens": "max_tokens", "repetition_penalty": "repeat_penalty"}
# what the API's fields may hold where they change nothing here (None: anything; "model" names the
# model asked for, the record says the one that ran); other values are refused, not ignored
OPENAI_ACCEPTED = {
    "model": None,
    "user": None,
    "metadata": None,
    "store": None,
    "service_tier": None,
    "parallel_tool_calls": None,
    "n": (1,),
    "stream": (False,),
    "stream_options": (None,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" calls none
}


def jsonl_lines(text: str) -> list[str]:
    """A JSONL text's lines: split at "\n" alone (a CRLF's "\r" dropped), never at the separators
    JSON leaves raw inside strings (U+2028, U+2029, U+0085, ...), where `str.splitlines` also breaks."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


@dataclass
class Output:
    """A job's output, opened for appending and locked against a second job on the same file, with
    what an earlier run of the job left in it."""

    file: TextIO
    done: set[str] = field(default_factory=set)  # keys of the ids written (results and error records alike)
    bad_lines: set[int] = field(default_factory=set)  # input lines recorded as errors without an id
    dropped: str = ""  # a last record cut short by a kill, removed from the file


def open_output(path: Path, resume: bool) -> Output:
    """Open `path` to append to, holding an exclusive lock while the job runs. With `resume`, read
    what is already there first: every complete line must be a record of ours (else the file is
    refused, untouched); a last line without its newline is kept if it is a whole record, and
    removed only if it is one cut short."""
    if resume and path.exists() and not path.is_file():  # a FIFO or a device would be read to exhaustion
        raise JaxinferError(f"{path} is not a regular file: resume reads back the results of an earlier run", "resume")
    try:
        raw = path.open("a+b")
    except OSError as e:
        raise JaxinferError(f"cannot write {path}: {e.strerror}") from None
    try:
        fcntl.flock(raw, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raw.close()
        raise JaxinferError(
            f"{path} is being written by another jaxinfer batch job; wait for it, or choose another output"
        ) from None
    output = Output(io.TextIOWrapper(raw, encoding="utf-8", newline="\n"))
    if resume:
        try:
            raw.seek(0)
            _read_earlier(path, raw, output)
        except BaseException:
            raw.close()
            raise
    return output


def _read_earlier(path: Path, raw, output: Output) -> None:
    data = raw.read()
    complete, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
    records = [_record(path, line) for line in complete.splitlines() if line.strip()]
    if tail.strip():
        try:
            records.append(_record(path, tail))
            raw.write(b"\n")  # a whole record that only lacked its newline
        except JaxinferError:
            if not tail.startswith(b'{"id": '):
                raise
            output.dropped = tail.decode("utf-8", errors="replace")
            raw.truncate(len(complete))
    for record in records:
        request_id = record.get("custom_id", record["id"])  # an OpenAI-shaped record: the request's custom_id
        if request_id is not None:
            output.done.add(_key(request_id))
        elif "error" in record and isinstance(record.get("line"), int):
            output.bad_lines.add(record["line"])


def _record(path: Path, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "id" not in record:
        raise JaxinferError(
            f"{path} has a line that is not a jaxinfer batch record; is it the output of a jaxinfer batch job?"
        )
    return record


class Job:
    """`max_tokens`: the job's budget per request where a line gives none; None: the model's default
    (generation_config.json's, else `defaults.MAX_TOKENS`), which shrinks to the room a prompt leaves,
    as `run`'s does. A budget given (by the line or the job) that the context cannot hold after the
    prompt is refused, never clipped: the caller asked for it."""

    def __init__(
        self,
        model: LoadedModel,
        context: int,
        max_tokens: int | None,
        output: TextIO,
        earlier: Output | None = None,
        speculating: bool = False,
    ):
        self.model, self.context, self.max_tokens, self.speculating = model, context, max_tokens, speculating
        self.output, self.earlier = output, earlier or Output(output)
        self.failed = self.written = self.skipped = 0
        self._seen: set[str] = set()
        self._openai: dict[str, tuple[str, str]] = {}  # key → endpoint and the model that ran, for OpenAI lines
        self._template: ChatTemplate | None = None

    def write(self, record: dict) -> None:
        """Write one record as it finishes: a result, or an error; in the OpenAI shape where the
        request came in it."""
        shape = self._openai.get(_key(record["id"]))
        if shape:
            record = _openai_result(record, *shape)
        text = json.dumps(record, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # an id holding a lone surrogate: JSON can carry it escaped
            text = json.dumps(record)
        self.output.write(text + "\n")
        self.output.flush()
        self.written += 1

    def requests(self, lines: Iterable[str]) -> Iterator[Request]:
        """The valid requests not already done; each bad line is written as an error record."""
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            request_id = None
            try:
                line.encode("utf-8")  # not UTF-8 bytes were read as surrogates
            except UnicodeEncodeError:
                self._fail(number, None, "the line is not UTF-8 text")
                continue
            openai = False
            try:
                try:
                    item = json.loads(line)
                except ValueError as e:  # json.JSONDecodeError included
                    raise JaxinferError(f"not valid JSON ({e})") from None
                if not isinstance(item, dict):
                    raise JaxinferError("a request must be a JSON object")
                openai = "body" in item or "url" in item
                request_id = item.get("custom_id") if openai else item.get("id", item.get("custom_id"))
                if request_id is None:
                    raise JaxinferError(
                        'an OpenAI batch line needs a "custom_id"'
                        if openai
                        else 'a request needs an "id" (or "custom_id")'
                    )
                key = _key(request_id)
                if key in self.earlier.done:
                    self.skipped += 1
                    continue
                if key in self._seen:
                    raise JaxinferError(f"duplicate id {request_id!r}")
                self._seen.add(key)
                if openai and not isinstance(request_id, str):
                    raise JaxinferError('"custom_id" must be a string, as OpenAI\'s batch input requires')
                if openai:
                    url, item = _from_openai(item)
                    self._openai[key] = (url, self.model.path.name)  # the model that ran, not the one asked for
                yield self._request(request_id, item)
            except JaxinferError as e:
                self._fail(number, request_id, str(e), openai)
            except (ValueError, TypeError, ArithmeticError) as e:  # a value no check foresaw: still this line only
                self._fail(number, request_id, f"bad value ({type(e).__name__}: {e})", openai)

    def _fail(self, number: int, request_id, message: str, openai: bool = False) -> None:
        if request_id is None and number in self.earlier.bad_lines:  # recorded by the run resumed
            self.skipped += 1
            return
        self.failed += 1
        if openai and request_id is not None:
            self.write(
                {
                    "id": _batch_id(),
                    "custom_id": request_id,
                    "response": None,
                    "error": {"code": "invalid_request", "message": message, "line": number},
                }
            )
        else:
            self.write({"id": request_id, "line": number, "error": message})

    def _request(self, request_id, item: dict) -> Request:
        _refuse_unknown(item, FIELDS)
        tokenizer = self.model.tokenizer
        if ("prompt" in item) == ("messages" in item):
            raise JaxinferError('a request needs exactly one of "prompt" and "messages"')
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise JaxinferError('"prompt" must be a non-empty string')
            check_text_fits(item["prompt"], tokenizer, self.context)
            ids = tokenizer.encode(item["prompt"])
        else:
            messages = item["messages"]
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise JaxinferError('"messages" must be a list of {"role", "content"} objects')
            if self._template is None:
                self._template = ChatTemplate.of(self.model)
            text = self._template.render(messages)
            check_text_fits(text, tokenizer, self.context)
            ids = tokenizer.encode(text, add_special_tokens=False)
        max_tokens = _whole(item, "max_tokens", self.max_tokens) if "max_tokens" in item else self.max_tokens
        if max_tokens is None:  # the default shrinks to fit, as run's
            default = self.model.max_new_tokens or defaults.MAX_TOKENS
            max_tokens = max(1, min(default, self.context - len(ids)))
        seed = _whole(item, "seed", shared_seed(), minimum=None)
        check_fits(len(ids), max_tokens, self.context)
        given = {k: item[k] for k in SAMPLING_FIELDS if k in item}
        for name, value in given.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise JaxinferError(f'"{name}" must be a number')
        sampling = replace(self.model.sampling, **given)
        stop = item.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise JaxinferError('"stop" must be a string or a list of strings')
        stop = tuple(stop) + (self._template.stop if "messages" in item else ())
        ignore_eos = item.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise JaxinferError('"ignore_eos" must be true or false')
        speculate = item.get("speculate", self.speculating)
        if not isinstance(speculate, bool):
            raise JaxinferError('"speculate" must be true or false')
        if speculate and not self.speculating:
            raise JaxinferError('"speculate": true needs a job that speculates (ngram or a draft model)')
        logprobs = item.get("logprobs")
        check_logprobs(logprobs)
        constraint = from_request(item)
        if constraint is not None:  # refused here, not at admission: a row that cannot start would end the job
            if mesh_of(self.model.params) is not None:
                raise JaxinferError("constrained output runs on one device: this job runs over several")
            check_for(constraint, tokenizer, self.model.config.sampled_ids, self.model.eos_ids)
        speculate &= constraint is None  # a constrained row drafts nothing
        return Request(request_id, ids, sampling, max_tokens, seed, stop, ignore_eos, speculate, logprobs, constraint)


def _whole(item: dict, name: str, default: int, minimum: int | None = 1) -> int:
    value = item.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise JaxinferError(f'"{name}" must be a whole number' + (f" ≥ {minimum}" if minimum is not None else ""))
    return value


def _refuse_unknown(item: dict, known: set[str], where: str = "") -> None:
    unknown = sorted(set(item) - known)
    if unknown:
        raise JaxinferError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}{where}")


def _from_openai(line: dict) -> tuple[str, dict]:
    """An OpenAI batch line as (endpoint, our request fields); the API's fields that change nothing
    here are accepted and dropped (`OPENAI_ACCEPTED`)."""
    _refuse_unknown(line, OPENAI_LINE, " in an OpenAI batch line")
    if line.get("method", "POST") != "POST":
        raise JaxinferError('"method" must be "POST"')
    url, body = line.get("url"), line.get("body")
    if url not in OPENAI_ENDPOINTS:
        raise JaxinferError(f'"url" must be one of {", ".join(OPENAI_ENDPOINTS)}, not {url!r}')
    if not isinstance(body, dict):
        raise JaxinferError('"body" must be a JSON object')
    body, item = dict(body), {}
    if url == "/v1/chat/completions":  # logprobs: true, top_logprobs: N (the completions endpoint: logprobs: N)
        asked, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
        if asked not in (None, True, False):
            raise JaxinferError('"logprobs" must be true or false')
        if top and not asked:  # 0, the API's default, changes nothing
            raise JaxinferError('"top_logprobs" needs "logprobs": true')
        if asked:
            item["logprobs"] = 0 if top is None else top
    elif body.get("logprobs") is False:  # the completions endpoint's is N or null; false is read as off
        del body["logprobs"]
    for name, value in body.items():
        if name in OPENAI_ACCEPTED:
            neutral = OPENAI_ACCEPTED[name]
            if neutral is not None and value is not None and value not in neutral:
                said = " or ".join(json.dumps(v) for v in neutral)
                raise JaxinferError(f'"{name}": only {said} is supported (any other value would change the answer)')
        elif name in ("prompt", "messages") and name != OPENAI_ENDPOINTS[url]:
            raise JaxinferError(f'{url} takes "{OPENAI_ENDPOINTS[url]}", not "{name}"')
        else:
            item[OPENAI_RENAMED.get(name, name)] = value
    return url, item


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


def _batch_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def _openai_result(record: dict, url: str, model: str) -> dict:
    """Our result record in the OpenAI batch output shape (error records already are)."""
    if "text" not in record:
        return record
    chat = url == "/v1/chat/completions"
    logprobs = record.get("logprobs")
    output = (
        {
            "message": {"role": "assistant", "content": record["text"]},
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
        }
        if chat
        else {"text": record["text"], "logprobs": None if logprobs is None else _completions_logprobs(logprobs)}
    )
    finish = {"length": "length", "unfinished": "length"}.get(record["finish_reason"], "stop")
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, **output, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": record["prompt_tokens"],
            "completion_tokens": record["generated_tokens"],
            "total_tokens": record["prompt_tokens"] + record["generated_tokens"],
        },
        "jaxinfer": {"finish_reason": record["finish_reason"], "seed": record["seed"], "timings": record["timings"]},
    }
    return {
        "id": _batch_id(),
        "custom_id": record["id"],
        "response": {"status_code": 200, "request_id": f"req_{secrets.token_hex(16)}", "body": body},
        "error": None,
    }
