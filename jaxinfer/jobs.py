"""Batch jobs: JSONL requests in, JSONL records out, each written and flushed as it is made.

An input line is {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} (rendered with the
model's chat template), with optional max_tokens, temperature, top_p, top_k, min_p, repeat_penalty,
seed, stop and ignore_eos; "custom_id" is accepted for "id". A bad line becomes an error record in the output
and the job goes on. The output is locked while a job writes it. On resume, ids already in the
output are skipped (and bad lines already recorded), and a last record cut short by a kill is
removed first, so every id ends up there exactly once.
"""

from __future__ import annotations

import fcntl
import io
import json
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, TextIO

from jaxinfer.batch import Request
from jaxinfer.chat_template import ChatTemplate, read_template
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")


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
    try:
        raw = path.open("a+b")
    except OSError as e:
        raise JaxinferError(f"cannot write {path}: {e.strerror}") from None
    try:
        fcntl.flock(raw, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raw.close()
        raise JaxinferError(f"{path} is being written by another jaxinfer batch job; wait for it, or choose another output") from None
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
        if record["id"] is not None:
            output.done.add(_key(record["id"]))
        elif "error" in record and isinstance(record.get("line"), int):
            output.bad_lines.add(record["line"])


def _record(path: Path, line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "id" not in record:
        raise JaxinferError(f"{path} has a line that is not a jaxinfer batch record; is it the output of a jaxinfer batch job?")
    return record


class Job:
    def __init__(self, model: LoadedModel, context: int, default_max_tokens: int, output: TextIO, earlier: Output | None = None):
        self.model, self.context, self.default_max_tokens = model, context, default_max_tokens
        self.output, self.earlier = output, earlier or Output(output)
        self.failed = self.written = self.skipped = 0
        self._seen: set[str] = set()
        self._template: ChatTemplate | None = None

    def write(self, record: dict) -> None:
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
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise JaxinferError("a request must be a JSON object")
                request_id = item.get("id", item.get("custom_id"))
                if request_id is None:
                    raise JaxinferError('a request needs an "id" (or "custom_id")')
                key = _key(request_id)
                if key in self.earlier.done:
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
        if request_id is None and number in self.earlier.bad_lines:  # recorded by the run resumed
            self.skipped += 1
            return
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
        seed = _whole(item, "seed", secrets.randbits(31), minimum=None)
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


def _whole(item: dict, name: str, default: int, minimum: int | None = 1) -> int:
    value = item.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise JaxinferError(f'"{name}" must be a whole number' + (f" ≥ {minimum}" if minimum is not None else ""))
    return value
