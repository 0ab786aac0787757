"""Batch jobs: JSONL requests in, JSONL records out, each written and flushed as it is made.

An input line is a request in our shape (`jaxinfer.api`) with an "id" ("custom_id" is accepted for
it), or a line in the OpenAI Batch API shape ({"custom_id", "method", "url", "body"}), whose result
is written in that API's output shape. A bad line, unknown fields included, becomes an error record in
the output and the job goes on. The output is locked while a job writes it. On resume, ids already in
the output are skipped (and bad lines already recorded), and a last record cut short by a kill is
removed first, so every id ends up there exactly once.
"""

from __future__ import annotations

import fcntl
import io
import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TextIO

from jaxinfer.api import ENDPOINTS, Parser, from_openai, openai_body, refuse_unknown
from jaxinfer.chat_template import ChatOptions
from jaxinfer.errors import JaxinferError
from jaxinfer.loading import LoadedModel
from jaxinfer.replies import Reading
from jaxinfer.scheduler import Request

OPENAI_LINE = {"custom_id", "method", "url", "body"}


def jsonl_lines(text: str) -> list[str]:
    """A JSONL text's lines: split at "\n" alone (a CRLF's "\r" dropped), never at the separators
    JSON leaves raw inside strings (U+2028, U+2029, U+0085, ...), where `str.splitlines` also breaks."""
    lines = text.removeprefix("\ufeff").split("\n")  # a byte-order mark (Windows editors) belongs to the file
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
        elif isinstance(line := _error_line(record), int):
            output.bad_lines.add(line)


def _error_line(record: dict) -> int | None:
    """The input line an error record without an id names (ours: "line"; OpenAI's: its error's)."""
    error = record.get("error")
    return (error.get("line") if isinstance(error, dict) else record.get("line")) if error else None


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
    """A job's lines as requests (`api.Parser`: `max_tokens` the job's budget where a line gives
    none, None the model's default) and its records written to `output`."""

    def __init__(
        self,
        model: LoadedModel,
        context: int,
        max_tokens: int | None,
        output: TextIO,
        earlier: Output | None = None,
        speculating: bool = False,
        chat: ChatOptions = ChatOptions(),
    ):
        self.model, self.parser = model, Parser(model, context, max_tokens, speculating, chat)
        self.output, self.earlier = output, earlier or Output(output)
        self.failed = self.written = self.skipped = 0
        self.openai = False  # every line that is a request is one of OpenAI's batch lines
        self._readings: dict[str, Reading] = {}  # key → how our own shape's chat lines read (`replies.Reading`)
        # key → endpoint, the model that ran and how its reply reads, for OpenAI lines
        self._openai: dict[str, tuple[str, str, Reading | None]] = {}

    def write(self, record: dict) -> None:
        """Write one record as it finishes: a result, or an error; in the OpenAI shape where the
        request came in it."""
        shape, reading = self._openai.get(_key(record["id"])), self._readings.get(_key(record["id"]))
        if shape:
            record = _openai_result(record, *shape)
        elif reading and "text" in record:  # as `run --json`: the text as made, and read
            record = record | dict(zip(("reasoning", "content", "tool_calls"), reading.reply(record["text"])))
        text = json.dumps(record, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # an id holding a lone surrogate: JSON can carry it escaped
            text = json.dumps(record)
        self.output.write(text + "\n")
        self.output.flush()
        self.written += 1

    def requests(self, lines: list[str]) -> Iterator[Request]:
        """The valid requests not already done; each bad line is written as an error record (in
        OpenAI's shape where every line that is a request is one of OpenAI's). A job whose lines
        repeat an id is refused before it starts: one id, one result."""
        self.openai = _check_ids(lines)
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
                openai, request_id = _shape_and_id(item)
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
                if openai and not isinstance(request_id, str):
                    raise JaxinferError('"custom_id" must be a string, as OpenAI\'s batch input requires')
                if openai:
                    url, item = _from_openai(item)
                request = self.parser.parse(request_id, {k: v for k, v in item.items() if k not in ("id", "custom_id")})
                if openai:  # the model that ran, not the one asked for
                    self._openai[key] = (url, self.model.path.name, request.reading)
                elif request.reading:  # tools offered, or a thinking model's reasoning: read apart
                    self._readings[key] = request.reading
                yield request
            except JaxinferError as e:
                self._fail(number, request_id, str(e), openai)
            except (ValueError, TypeError, ArithmeticError) as e:  # a value no check foresaw: still this line only
                self._fail(number, request_id, f"bad value ({type(e).__name__}: {e})", openai)

    def _fail(self, number: int, request_id, message: str, openai: bool = False) -> None:
        if request_id is None and number in self.earlier.bad_lines:  # recorded by the run resumed
            self.skipped += 1
            return
        self.failed += 1
        if openai or self.openai:
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


def _shape_and_id(item: dict) -> tuple[bool, object]:
    """Whether a request line is one of OpenAI's batch lines, and its id (OpenAI's: custom_id)."""
    openai = "body" in item or "url" in item
    return openai, item.get("custom_id") if openai else item.get("id", item.get("custom_id"))


def _check_ids(lines: list[str]) -> bool:
    """Refuse a job whose lines repeat an id (naming it and the lines); whether it is OpenAI's:
    lines that read as requests, all in OpenAI's batch shape."""
    seen: dict[str, int] = {}
    shapes = set()
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        openai, request_id = _shape_and_id(item)
        shapes.add(openai)
        if request_id is None:
            continue
        key = _key(request_id)
        if key in seen:
            raise JaxinferError(
                f"lines {seen[key]} and {number} have the same id {request_id!r}: each request needs its own"
            )
        seen[key] = number
    return shapes == {True}


def _from_openai(line: dict) -> tuple[str, dict]:
    """An OpenAI batch line as (endpoint, our request fields: `api.from_openai`)."""
    refuse_unknown(line, OPENAI_LINE, " in an OpenAI batch line")
    if line.get("method", "POST") != "POST":
        raise JaxinferError('"method" must be "POST"')
    url, body = line.get("url"), line.get("body")
    if url not in ENDPOINTS:
        raise JaxinferError(f'"url" must be one of {", ".join(ENDPOINTS)}, not {url!r}')
    if not isinstance(body, dict):
        raise JaxinferError('"body" must be a JSON object')
    return url, from_openai(url, body)


def _batch_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def _openai_result(record: dict, url: str, model: str, reading: Reading | None) -> dict:
    """Our result record in the OpenAI batch output shape (error records already are)."""
    if "text" not in record:
        return record
    return {
        "id": _batch_id(),
        "custom_id": record["id"],
        "response": {
            "status_code": 200,
            "request_id": f"req_{secrets.token_hex(16)}",
            "body": openai_body([record], url, model, reading),
        },
        "error": None,
    }
