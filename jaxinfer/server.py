"""`jaxinfer serve`: the HTTP APIs clients speak, over the one scheduler.

Every request of every client joins the same device batch as it arrives (`Scheduler` over an
`Inbox`: continuous batching, chunked prefill beside running rows, prefix reuse across requests),
parsed by the same `api.Parser` as a batch job's lines. The scheduler runs in a thread of its own;
the HTTP side is Starlette on uvicorn (asyncio), and the two meet in thread-safe hand-overs: a
handler puts its requests in the inbox, the scheduler's thread calls each request's `on_text` and
the result callback, which post events to the handler's asyncio queue.

Endpoints, each protocol an adapter over the same parser and scheduler (`jaxinfer.protocols`):
POST /v1/chat/completions and /v1/completions (server-sent events with `"stream": true`), OpenAI's
/v1/responses (`jaxinfer.responses`), Anthropic's /v1/messages and /v1/messages/count_tokens
(`jaxinfer.anthropic`), ollama's /api/chat, /api/generate, /api/show and GET /api/tags, /api/ps,
/api/version (`jaxinfer.ollama`), llama-server's /tokenize, /detokenize, /apply-template and GET
/props (`jaxinfer.utilities`), POST /v1/embeddings and ollama's /api/embed (`jaxinfer.embeddings`:
texts embedded in the scheduler's rounds), GET /v1/models, / (a chat page: `jaxinfer/web`), /health
(open without the key) and /metrics (Prometheus text: `jaxinfer.metrics`). A client that goes away
cancels its requests: their rows stop at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from functools import partial

from starlette.responses import JSONResponse, StreamingResponse

from jaxinfer import anthropic, embeddings, ollama, protocols, utilities
from jaxinfer.api import Parser
from jaxinfer.errors import JaxinferError
from jaxinfer.metrics import Metrics
from jaxinfer.protocols import PROTOCOLS, Protocol
from jaxinfer.replies import Reading
from jaxinfer.scheduler import Inbox, Request, Scheduler

# decode steps per dispatch: about this long, so text streams and new requests start that often (0.1 s
# measured no faster: 64 clients, bundled model, two A/B rounds, ×0.80–0.84 against ×0.87 of batch)
INTERVAL_S = 0.05
EMBEDDINGS = ("/v1/embeddings", "/api/embed", "/api/embeddings")  # OpenAI's, ollama's and its older one


class HTTPError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}

    def response(self):
        return JSONResponse(self.body(), status_code=self.status)


def authorize(headers, api_key: str | None) -> None:
    """Refuse a request (its case-insensitive `headers`) without `api_key` as a bearer token, or as
    Anthropic's clients say it (x-api-key); None: every request passes."""
    if api_key is None:
        return
    given = headers.get("authorization", "")
    if "x-api-key" in headers:
        given = f"Bearer {headers['x-api-key']}"
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise HTTPError(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error")


@dataclass
class _Pending:
    """One HTTP request's choices on their way: the scheduler's thread posts ("text", index, piece,
    entries), ("done", index, record) and ("failed", index, message, status) events to `events`, in
    the handler's loop."""

    loop: asyncio.AbstractEventLoop
    requests: list[Request]
    id: str = ""  # the response's
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token: list[float] = field(default_factory=list)  # per choice, for the ITL histogram

    def post(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server stopped, and no one waits for it
            pass

    def cancel(self) -> None:
        for request in self.requests:
            request.cancelled = True


class Server:
    """`make_scheduler()`: a fresh scheduler (its thread makes another where one fails).
    `api_key`: required as a bearer token on every endpoint but /health; `max_queue`: requests
    waiting for a slot at most, and embedding requests waiting for the next round (more are refused
    with 429); `max_body`: bytes a request body may hold."""

    def __init__(
        self,
        make_scheduler,
        parser: Parser,
        model_name: str,
        api_key: str | None = None,
        max_queue: int = 256,
        max_body: int = 16 << 20,
    ):
        self.parser, self.model_name, self.api_key = parser, model_name, api_key
        self.max_queue, self.max_body = max_queue, max_body
        self.inbox = Inbox()
        self.inbox.on_dropped = self._dropped
        self.scheduler: Scheduler = make_scheduler()
        self._make_scheduler = make_scheduler
        self._pending: dict[str, _Pending] = {}  # request id → its handler's hand-over
        self._thread = threading.Thread(target=self._work, name="jaxinfer-scheduler", daemon=True)
        self.metrics = Metrics(self)

    # the scheduler's side -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No new requests; those taken finish; then the scheduler's thread ends."""
        self.inbox.close()
        self._thread.join()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot: those put that the free slots will not take at once."""
        return max(0, len(self.inbox) - (self.scheduler.batch_size - self.scheduler.busy))

    def cancel_all(self) -> None:
        """Ctrl-C: running rows stop at the next step with what they made; waiting ones are refused now."""
        for pending in list(self._pending.values()):
            pending.cancel()
        self.inbox.drop_waiting()

    def _dropped(self, request: Request) -> None:
        """A request cancelled before it started: its client (if still there) is told so."""
        request_id, index = request.id
        if (pending := self._pending.get(request_id)) is not None:
            pending.post("failed", index, "the server is shutting down: this request was not started", 503)

    def _work(self) -> None:
        while not self.inbox.done:
            try:
                self.scheduler.run(self.inbox, self._finished)
            except Exception as e:  # the device or a bug: fail what was running, keep serving on a fresh state
                traceback.print_exc(file=sys.stderr)
                for pending in list(self._pending.values()):
                    for i, request in enumerate(pending.requests):
                        pending.post("failed", i, f"generation failed: {type(e).__name__}: {e}", 500)
                self.scheduler = self._make_scheduler()

    def _finished(self, record: dict) -> None:
        request_id, index = record["id"]
        pending = self._pending.get(request_id)
        self.metrics.generated.inc(record["generated_tokens"])
        self.metrics.prompt_tokens.inc(record["prompt_tokens"])
        self.metrics.cached_tokens.inc(record["cached_tokens"])
        if pending is not None:
            pending.post("done", index, record)

    def _on_text(self, pending: _Pending, index: int):
        def on_text(piece: str, tokens: int, entries: list[dict]) -> None:
            now = time.perf_counter()
            if pending.last_token[index]:
                for _ in range(tokens):
                    self.metrics.itl.observe((now - pending.last_token[index]) / tokens)
            else:
                self.metrics.ttft.observe(now - pending.requests[index].arrived)
            pending.last_token[index] = now
            pending.post("text", index, piece, entries)

        return on_text

    # the HTTP side -------------------------------------------------------------------------------

    @functools.cached_property
    def asgi(self):
        """Its app (`app`), made once."""
        return self.app()

    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def http_exception(request, e: HTTPException):
            return HTTPError(e.status_code, e.detail or "").response()

        routes = [Route(url, self._answer(protocol), methods=["POST"]) for url, protocol in PROTOCOLS.items()]
        routes += [
            Route("/v1/messages/count_tokens", self._count_tokens, methods=["POST"]),
            *(Route(url, self._embeddings(url), methods=["POST"]) for url in EMBEDDINGS),
            Route("/api/show", self._ollama_show, methods=["POST"]),
            *(Route(f"/api/{name}", self._ollama_listed(name), methods=["GET"]) for name in ("tags", "ps", "version")),
            *(Route(f"/{name}", self._utility(name), methods=["POST"]) for name in ("tokenize", "detokenize")),
            Route("/apply-template", self._utility("apply_template"), methods=["POST"]),
            Route("/props", self._props, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/", self._page, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics_text, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: http_exception})

    def _authorize(self, request) -> None:
        authorize(request.headers, self.api_key)

    async def _page(self, request):
        """The chat page (`jaxinfer/web/index.html`): open without the key, which it asks for."""
        from importlib import resources

        from starlette.responses import HTMLResponse

        return HTMLResponse((resources.files("jaxinfer") / "web" / "index.html").read_text())

    async def _health(self, request):
        return JSONResponse({"status": "draining" if self.inbox.closed else "ok"})

    async def _models(self, request):
        try:
            self._authorize(request)
        except HTTPError as e:
            return e.response()
        model = {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "jaxinfer"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _metrics_text(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response

        try:
            self._authorize(request)
        except HTTPError as e:
            return e.response()
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def _answer(self, protocol: Protocol):
        """A POST endpoint of `protocol` (`jaxinfer.protocols`): the body read, the request put in the
        inbox, its answer written whole or streamed, errors in the protocol's shape."""

        async def answer(request):
            url = request.url.path
            try:
                self._authorize(request)
                call = protocol.read(url, await self._body(request))
                if call.item is None:  # answered at once (ollama's load request)
                    return JSONResponse(call.answer)
                pending = await self._submit(url, call.item, call.n, call.id)
            except Exception as e:  # `_refused` answers what it knows, raises the rest
                return self._refused(url, e, protocol.error)
            first = pending.requests[0]
            call.model, call.reading, call.prompt_tokens = (
                self.model_name,
                first.reading or Reading(),
                len(first.prompt_ids),
            )
            if call.stream:
                pieces = self._pieces(url, pending, call.reading)
                headers = {"Cache-Control": "no-cache"}
                return StreamingResponse(protocol.stream(url, call, pieces), media_type=protocol.media, headers=headers)
            records = await self._records(request, url, pending, protocol.error)
            return records if not isinstance(records, list) else JSONResponse(protocol.whole(url, call, records))

        return answer

    def _embeddings(self, url: str):
        """An embedding endpoint, OpenAI's (/v1/embeddings) or ollama's (/api/embed, the older
        /api/embeddings): the body read (an `embeddings.Asked`), its texts tokenized (in a thread)
        and embedded in the scheduler's next round beside every other waiting (`embeddings.run_jobs`),
        the vectors answered in the endpoint's shape."""
        from starlette.concurrency import run_in_threadpool

        legacy, ollama_shaped = url == "/api/embeddings", url.startswith("/api/")
        read = partial(ollama.embed_request, legacy=legacy) if ollama_shaped else embeddings.read_openai
        shape = protocols.OLLAMA.error if ollama_shaped else None

        def answer(vectors, asked: embeddings.Asked, tokens: int, seconds: float) -> dict:
            if ollama_shaped:
                return ollama.embed_answer(self.model_name, vectors, tokens, seconds, legacy)
            return embeddings.openai_answer(vectors, asked, self.model_name, tokens)

        async def handle(request):
            url, started, model = request.url.path, time.perf_counter(), self.parser.model
            try:
                self._authorize(request)
                asked = read(await self._body(request))
                ids, skips = await run_in_threadpool(embeddings.tokenized, model, asked, self.parser.context)
                vectors = embeddings.shortened(await self._embedded(ids, skips), asked.dimensions, model.pooler)
            except Exception as e:  # as in _answer
                return self._refused(url, e, shape)
            tokens = sum(map(len, ids))
            self.metrics.prompt_tokens.inc(tokens)
            self.metrics.requests.labels(url, "200").inc()
            return JSONResponse(answer(vectors, asked, tokens, time.perf_counter() - started))

        return handle

    async def _embedded(self, ids: list[list[int]], skips: list[int]):
        """The texts' vectors, from the scheduler's thread."""
        loop = asyncio.get_running_loop()
        vectors = loop.create_future()

        def done(result) -> None:
            if isinstance(result, Exception):
                result = HTTPError(500, f"embedding failed: {type(result).__name__}: {result}", "server_error")

            def settle() -> None:
                if not vectors.done():  # else the client went away
                    (vectors.set_exception if isinstance(result, Exception) else vectors.set_result)(result)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed: the server stopped, and no one waits for it
                pass

        if self.inbox.texts_waiting >= self.max_queue:
            waiting = self.inbox.texts_waiting
            raise HTTPError(429, f"{waiting} embedding requests are waiting (the queue holds {self.max_queue})")
        try:
            self.inbox.put(embeddings.Job(ids, skips, done))
        except JaxinferError:  # closed (SIGTERM)
            raise HTTPError(503, "the server is shutting down", "server_error") from None
        return await vectors

    async def _count_tokens(self, request):
        """Anthropic's /v1/messages/count_tokens: the prompt's tokens, nothing generated."""
        from starlette.concurrency import run_in_threadpool

        url = request.url.path
        try:
            self._authorize(request)
            body = await self._body(request)
            item = anthropic.to_item({"max_tokens": 1} | body)
            parsed = await run_in_threadpool(self.parser.parse, None, item)
        except Exception as e:  # as in _answer
            return self._refused(url, e, anthropic.error_body)
        self.metrics.requests.labels(url, "200").inc()
        return JSONResponse({"input_tokens": len(parsed.prompt_ids)})

    def _utility(self, name: str):
        """llama-server's utility endpoint `name` (`jaxinfer.utilities`): the body in, the answer out."""
        from starlette.concurrency import run_in_threadpool

        async def answer(request):
            url = request.url.path
            try:
                self._authorize(request)
                said = await run_in_threadpool(getattr(utilities, name), self.parser, await self._body(request))
            except Exception as e:  # as in _answer
                return self._refused(url, e)
            self.metrics.requests.labels(url, "200").inc()
            return JSONResponse(said)

        return answer

    async def _ollama_show(self, request):
        try:
            self._authorize(request)
            await self._body(request)  # names the model: there is one
        except Exception as e:  # as in _answer
            return self._refused(request.url.path, e, protocols.OLLAMA.error)
        return JSONResponse(ollama.show(self.parser.model, self.model_name, self.parser.context))

    def _ollama_listed(self, name: str):
        """ollama's /api/tags and /api/ps (the one model, loaded), /api/version."""

        async def answer(request):
            try:
                self._authorize(request)
            except HTTPError as e:
                return e.response()
            if name == "version":
                return JSONResponse({"version": ollama.VERSION})
            return JSONResponse({"models": [ollama.listed(self.parser.model, self.model_name)]})

        return answer

    async def _props(self, request):
        try:
            self._authorize(request)
        except HTTPError as e:
            return e.response()
        return JSONResponse(utilities.props(self.parser, self.scheduler.batch_size))

    def _refused(self, url: str, e: Exception, shape=None):
        """A request refused before it ran, answered in its protocol's error shape (`shape(message,
        status)`; OpenAI's by default); an exception no check foresaw is raised on."""
        if isinstance(e, JaxinferError):
            e = HTTPError(400, str(e), param=e.names[0] if e.names else None)
        elif isinstance(e, (ValueError, TypeError, ArithmeticError)):  # a value no check foresaw: still this request's
            e = HTTPError(400, f"bad value ({type(e).__name__}: {e})")
        elif not isinstance(e, HTTPError):
            raise e
        self.metrics.requests.labels(url, str(e.status)).inc()
        return e.response() if shape is None else JSONResponse(shape(str(e), e.status), status_code=e.status)

    async def _submit(self, url: str, item: dict, n: int, request_id: str) -> _Pending:
        """Our request `item` parsed (in a thread: tokenizing a long prompt takes a while) and put, as
        `n` choices, in the scheduler's inbox."""
        from starlette.concurrency import run_in_threadpool

        base = await run_in_threadpool(self.parser.parse, None, item)
        if self.inbox.closed:
            raise HTTPError(503, "the server is shutting down", "server_error")
        if self.waiting + n > self.max_queue:
            raise HTTPError(429, f"{self.waiting} requests are waiting for a slot (the queue holds {self.max_queue})")
        pending = _Pending(asyncio.get_running_loop(), [], id=request_id)
        now = time.perf_counter()
        for i in range(n):
            choice = replace(base, id=(request_id, i), seed=base.seed + i, arrived=now)
            choice.on_text = self._on_text(pending, i)  # the TTFT and ITL histograms, and streaming
            pending.requests.append(choice)
        pending.last_token = [0.0] * n
        self._pending[request_id] = pending
        try:
            for choice in pending.requests:
                self.inbox.put(choice)
        except JaxinferError:  # closed since the check above (SIGTERM): the choices put are cancelled
            pending.cancel()
            self._pending.pop(request_id, None)
            raise HTTPError(503, "the server is shutting down", "server_error") from None
        return pending

    async def _body(self, request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise HTTPError(413, f"the request body is over {self.max_body} bytes")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.max_body:
                raise HTTPError(413, f"the request body is over {self.max_body} bytes")
        try:
            body = json.loads(data)
        except ValueError as e:
            raise HTTPError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body

    async def _records(self, request, url: str, pending: _Pending, shape=None):
        """Every choice's record, in order; or the response that ends the request instead (a failure,
        in `shape` as `_refused`'s; a client that went away first, whose choices are cancelled)."""
        records: dict[int, dict] = {}
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while len(records) < len(pending.requests):
                got = asyncio.ensure_future(pending.events.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    pending.cancel()
                    self.metrics.requests.labels(url, "499").inc()
                    return JSONResponse({}, status_code=499)  # nobody reads it
                kind, index, *rest = got.result()
                if kind == "failed":
                    self.metrics.requests.labels(url, str(rest[1])).inc()
                    failure = HTTPError(rest[1], rest[0], "server_error")
                    return failure.response() if shape is None else JSONResponse(shape(rest[0], rest[1]), rest[1])
                if kind == "done":
                    records[index] = rest[0]
        finally:
            gone.cancel()
            self._pending.pop(pending.id, None)
        self.metrics.requests.labels(url, "200").inc()
        return [records[i] for i in range(len(records))]

    async def _pieces(self, url: str, pending: _Pending, reading: Reading):
        """A request's choices as they come, read (`Reading.visible`): ("piece", index, reasoning,
        content, entries) for what is new, ("end", index, record, reasoning, content, calls) with what
        the end lets through (held text, calls whole), ("failed", message, status) if the scheduler
        fails. A client that goes away before the end cancels the rest; the status is counted."""
        n = len(pending.requests)
        made, sent, records, status = [""] * n, [(0, 0)] * n, {}, "200"
        try:
            while len(records) < n:
                kind, index, *rest = await pending.events.get()
                if kind == "failed":
                    status = str(rest[1])
                    yield ("failed", *rest)
                    break
                if kind == "text":
                    piece, entries = rest
                    made[index] += piece
                    (reasoning, content), (said, shown) = reading.visible(made[index]), sent[index]
                    if len(content) > shown or len(reasoning) > said or entries:
                        yield "piece", index, reasoning[said:], content[shown:], entries
                        sent[index] = (max(said, len(reasoning)), max(shown, len(content)))
                else:
                    record = records[index] = rest[0]
                    reasoning, content, calls = reading.reply(record["text"])
                    said, shown = sent[index]  # what the end let through (held text)
                    yield "end", index, record, (reasoning or "")[said:], (content or "")[shown:], calls
        finally:
            if len(records) < n:  # the client went away (or the scheduler failed): free the rows
                pending.cancel()
                status = "499" if status == "200" else status
            self._pending.pop(pending.id, None)
            self.metrics.requests.labels(url, status).inc()


async def _disconnected(request) -> None:
    """Returns when the client goes away (the body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
