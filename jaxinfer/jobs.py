"""Batch jobs: JSONL requests in, JSONL records out, each written and flushed as it is made.

An input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} (rendered with the
model's chat template), with optional max_tokens, temperature, top_p, top_k, min_p, repeat_penalty,
seed, stop and ignore_eos; "custom_id" is accepted for "id". A bad line becomes an error record in the output
and the job goes on. On resume, ids already in the output are skipped, and a last line cut short by
a kill is removed first, so every id ends up there exactly once.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator, TextIO

from jaxinfer.batch import Request
from jaxinfer.chat_template import ChatTemplate, read_template
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")


def _key(request_id) -> str:
    return json.dumps(request_id, sort_keys=True)


def finished_ids(output: Path) -> set[str]:
    """Keys of the ids an earlier run of the job already wrote (results and error records alike).
    A last line without its newline was cut short by a kill: it is removed from the file."""
    if not output.is_file():
        return set()
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with output.open("r+b") as f:
            f.truncate(len(complete))
    keys = set()
    for line in complete.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise JaxinferError(f"{output} has a line that is not JSON; is it the output of a jaxinfer batch job?") from None
        if isinstance(record, dict) and record.get("id") is not None:
            keys.add(_key(record["id"]))
    return keys


class Job:
    def __init__(self, model: LoadedModel, context: int, default_max_tokens: int, output: TextIO, skip: set[str]):
        self.model, self.context, self.default_max_tokens = model, context, default_max_tokens
        self.output, self.skip = output, skip
        self.failed = self.written = self.skipped = 0
        self._seen: set[str] = set()
        self._template: ChatTemplate | None = None

    def write(self, record: dict) -> None:
        self.output.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.output.flush()
        self.written += 1

    def requests(self, lines: Iterable[str]) -> Iterator[Request]:
        """The valid requests not already done; each bad line is written as an error record."""
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            request_id = None
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise JaxinferError("a request must be a JSON object")
                request_id = item.get("id", item.get("custom_id"))
                if request_id is None:
                    raise JaxinferError('a request needs an "id" (or "custom_id")')
                key = _key(request_id)
                if key in self.skip:
                    self.skipped += 1
                    continue
                if key in self._seen:
                    raise JaxinferError(f"duplicate id {request_id!r}")
                self._seen.add(key)
                yield self._request(request_id, item)
            except ValueError as e:  # json.JSONDecodeError included
                self._fail(number, request_id, f"not valid JSON ({e})")
            except JaxinferError as e:
                self._fail(number, request_id, str(e))

    def _fail(self, number: int, request_id, message: str) -> None:
        self.failed += 1
        self.write({"id": request_id, "line": number, "error": message})

    def _request(self, request_id, item: dict) -> Request:
        tokenizer = self.model.tokenizer
        if ("prompt" in item) == ("messages" in item):
            raise JaxinferError('a request needs exactly one of "prompt" and "messages"')
        if "prompt" in item:
            if not isinstance(item["prompt"], str) or not item["prompt"]:
                raise JaxinferError('"prompt" must be a non-empty string')
            ids = tokenizer.encode(item["prompt"])
        else:
            messages = item["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise JaxinferError('"messages" must be a list of {"role", "content"} objects')
            if self._template is None:
                self._template = ChatTemplate(read_template(self.model.path, tokenizer.config), tokenizer.special_tokens)
            ids = tokenizer.encode(self._template.render(messages), add_special_tokens=False)
        max_tokens = _whole(item, "max_tokens", self.default_max_tokens)
        seed = _whole(item, "seed", secrets.randbits(31), minimum=0)
        if len(ids) + max_tokens > self.context:
            raise JaxinferError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {self.context}"
            )
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
        return Request(request_id, ids, sampling, max_tokens, seed, stop, ignore_eos)


def _whole(item: dict, name: str, default: int, minimum: int = 1) -> int:
    value = item.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise JaxinferError(f'"{name}" must be a whole number ≥ {minimum}')
    return value
