"""Several models behind one address (`jaxinfer serve -m A -m B`, `--models-dir DIR`), as
llama-server's router mode and ollama serve them: each model a `Server` of its own (its weights,
scheduler and slots), made on its first request; where more than `models_max` would be held, or
their bytes would pass `memory` (weights and cache: as measured once a model was held, before that
its files' size), the least recently used ones with no request in flight are stopped first, and a
request for another model waits until they are (one model alone is always held). A request goes to
the model its body's `model` names or one of its `aliases` does (GET: the `model` query parameter:
/props, /metrics), the first model where it names none; with one model served, the name is not
checked (clients send any); GET /metrics without `model` gives every held model's, labelled by
`model_name`. A model idle for `keep_alive` seconds (ollama's; its requests' own
`keep_alive` says it for that model from then on, 0 stopping it once answered) is stopped, to be
made again on its next request. GET /v1/models and /api/tags list every model and alias, /api/ps
those held; /health answers for the router.

The router is an ASGI app in front of the servers' own: it reads a POST body to find the model,
then hands the request to that server's app with the body replayed, so each endpoint, protocol and
error shape is the server's, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from jaxinfer import metrics, ollama
from jaxinfer.errors import JaxinferError
from jaxinfer.server import HTTPError, Server, authorize


class Router:
    """`models`: name → a function making its Server (loading its weights: called in a thread);
    the first is the default, made at once. `aliases`: another name → a model's; `memory`: the bytes
    the models held may take together (None: no bound but `models_max`), `sizes` each model's bytes
    before it was first held (its files'); `keep_alive`: the seconds an idle model stays held (None:
    for ever)."""

    def __init__(
        self,
        models: dict[str, Callable[[], Server]],
        models_max: int = 2,
        api_key: str | None = None,
        max_body: int = 16 << 20,
        aliases: dict[str, str] | None = None,
        memory: int | None = None,
        sizes: dict[str, int] | None = None,
        keep_alive: float | None = None,
    ):
        self.makers, self.models_max, self.api_key, self.max_body = models, max(1, models_max), api_key, max_body
        self.aliases, self.memory, self.sizes = aliases or {}, memory, dict(sizes or {})
        self.keep = dict.fromkeys(models, keep_alive)  # name → seconds it stays held idle (None: for ever)
        self.default = next(iter(models))
        self.servers: dict[str, Server] = {}
        self.used: dict[str, float] = {}  # name → when its last request ended
        self.in_flight: dict[str, int] = {name: 0 for name in models}
        self._switch = asyncio.Lock()  # one load or unload at a time
        self._freed: asyncio.Event | None = None  # set as a model's last request ends
        self.wanting = dict.fromkeys(models, 0)  # name → requests waiting for it to be made
        self._changed: asyncio.Event | None = None  # set as such a request stops waiting
        self.closed = False
        self._start(self.default, self.makers[self.default]())

    def _start(self, name: str, server: Server) -> None:
        server.start()
        self.servers[name], self.used[name] = server, time.monotonic()
        self.sizes[name] = held_bytes(server)

    def _fits(self, name: str) -> bool:
        """Whether the model may be made beside those held: within `models_max`, and `memory`."""
        if len(self.servers) >= self.models_max:
            return False
        held = sum(self.sizes.get(n, 0) for n in self.servers)
        return self.memory is None or not self.servers or held + self.sizes.get(name, 0) <= self.memory

    # what `serve` asks of it on SIGTERM and Ctrl-C ----------------------------------------------

    @property
    def running(self) -> int:
        return sum(s.scheduler.busy + len(s.inbox) for s in self.servers.values())

    def cancel_all(self) -> None:
        for server in self.servers.values():
            server.cancel_all()

    def stop(self) -> None:
        self.closed = True
        for server in list(self.servers.values()):
            server.stop()

    # the ASGI app -------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/v1/models", "/api/tags", "/api/ps", "/health"):
            return await self._listed(scope, send, path)
        if method == "GET" and path == "/metrics" and len(self.makers) > 1 and self._asked(scope, None) is None:
            return await self._listed(scope, send, path)
        body = b""
        if method == "POST":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if len(body) > self.max_body:
                    error = {
                        "message": f"the request body is over {self.max_body} bytes",
                        "type": "invalid_request_error",
                    }
                    return await _send_json(send, 413, {"error": error})
                if message["type"] == "http.disconnect" or not message.get("more_body"):
                    break
        said = _json(body) if method == "POST" else None  # None: the server answers a bad body
        name = self._named(scope, said)
        if name is None:
            served = self.makers if len(self.makers) < 16 else []
            known = f" (served: {', '.join(served)})" if served else ": GET /v1/models lists them"
            message = f"model {self._asked(scope, said)!r} is not served here{known}"
            return await _send_json(
                send,
                404,
                {
                    "error": {
                        "message": message,
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
            )
        if path.startswith("/api/") and said and "keep_alive" in said:
            try:
                self.keep[name] = ollama.keep_alive(said["keep_alive"])
            except JaxinferError as e:
                return await _send_json(send, 400, {"error": str(e)})
            if self.keep[name] == 0 and path == "/api/generate" and ollama.loads(said):  # ollama's "unload it"
                async with self._switch:
                    if name in self.servers and self.in_flight[name] == 0:
                        await self._unload(name)
                return await _send_json(send, 200, ollama.loaded(said, "unload"))
        try:
            server = await self._server(name)
        except Exception as e:  # its weights could not be read (the disk, memory): this request's answer
            error = {"message": f"model {name!r} could not be loaded: {e}", "type": "server_error", "code": None}
            return await _send_json(send, 500, {"error": error})
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # what comes next: the client's going away

        try:
            await server.asgi(scope, replay, send)
        finally:
            self.in_flight[name] -= 1
            self.used[name] = time.monotonic()
            if self.in_flight[name] == 0 and self._freed is not None:
                self._freed.set()
            if (keep := self.keep[name]) is not None:
                asyncio.get_running_loop().call_later(keep, lambda: asyncio.ensure_future(self._expire(name)))

    async def _expire(self, name: str) -> None:
        """Stop the model if it has been idle its `keep_alive` (a later request moved that on)."""
        async with self._switch:
            keep = self.keep[name]
            idle = time.monotonic() - self.used.get(name, 0)
            if name in self.servers and self.in_flight[name] == 0 and keep is not None and idle >= keep - 1e-3:
                await self._unload(name)

    def _asked(self, scope, said: dict | None) -> str | None:
        """The model a request names: its POST body's (`said`, read once), else its query's."""
        if scope["method"] == "POST":
            return said.get("model") if said and isinstance(said.get("model"), str) else None
        query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p)
        return query.get("model")

    def _named(self, scope, said: dict | None) -> str | None:
        """The model a request is for: the one it names (also as `ollama:NAME`, or by an alias), the
        default where it names none or one model is served; None: one not served."""
        asked = self._asked(scope, said)
        if len(self.makers) == 1 or asked is None or asked == "":
            return self.default
        asked = self.aliases.get(asked, asked)
        return asked if asked in self.makers else ("ollama:" + asked if "ollama:" + asked in self.makers else None)

    async def _server(self, name: str) -> Server:
        """The model's server, made where it is not held (others stopped first where it would not
        fit: `_fits`); its request counted in flight before any other request can stop it. While a
        request waits for another model to be made, a held model takes no new ones: its requests in
        flight end, and it can be stopped for the other (a model asked for without pause would keep
        another waiting for ever)."""
        while name in self.servers and any(n not in self.servers for n, k in self.wanting.items() if k):
            self._changed = self._changed or asyncio.Event()
            await self._changed.wait()
        if name not in self.servers:
            self.wanting[name] += 1
            try:
                await self._make(name)
            finally:
                self.wanting[name] -= 1
                if self._changed is not None:  # the requests held back look again
                    self._changed.set()
                    self._changed = None
        self.in_flight[name] += 1
        return self.servers[name]

    async def _make(self, name: str) -> None:
        """Make the model's server, stopping the least recently used idle ones until it fits."""
        if name not in self.servers:
            async with self._switch:
                while name not in self.servers:
                    if self._fits(name):
                        from starlette.concurrency import run_in_threadpool

                        self._start(name, await run_in_threadpool(self.makers[name]))
                        break
                    idle = [n for n in self.servers if self.in_flight[n] == 0]
                    if not idle:  # every model held is answering: wait for one to finish
                        self._freed = self._freed or asyncio.Event()
                        self._freed.clear()
                        await self._freed.wait()
                        continue
                    await self._unload(min(idle, key=self.used.__getitem__))

    async def _unload(self, name: str) -> None:
        import gc

        from starlette.concurrency import run_in_threadpool

        server = self.servers.pop(name)  # no request reaches it from here on
        await run_in_threadpool(server.stop)
        del server
        gc.collect()  # its weights and cache go now, before the next model's are read

    async def _listed(self, scope, send, path: str) -> None:
        if path == "/health":
            return await _send_json(send, 200, {"status": "draining" if self.closed else "ok"})
        from starlette.datastructures import Headers

        try:
            authorize(Headers(scope=scope), self.api_key)
        except HTTPError as e:
            return await _send_json(send, e.status, e.body())
        if path == "/metrics":  # every model held, each sample labelled with its name
            from prometheus_client import CONTENT_TYPE_LATEST

            data = metrics.merged(self.servers)
            headers = [(b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            return await send({"type": "http.response.body", "body": data})
        if path == "/v1/models":  # an alias says its model (vLLM's `parent`)
            names = [(n, None) for n in self.makers] + list(self.aliases.items())
            data = [
                {"id": n, "object": "model", "created": int(time.time()), "owned_by": "jaxinfer"}
                | ({"parent": model} if model else {})
                for n, model in names
            ]
            return await _send_json(send, 200, {"object": "list", "data": data})
        held = [ollama.listed(s.parser.model, n) for n, s in self.servers.items()]
        if path == "/api/ps":  # those held now
            return await _send_json(send, 200, {"models": held})
        others = [
            {
                "name": n,
                "model": n,
                "modified_at": ollama.now(),
                "size": self.sizes.get(n, 0),
                "digest": "",
                "details": {},
            }
            for n in [*self.makers, *self.aliases]
            if n not in self.servers
        ]
        return await _send_json(send, 200, {"models": held + others})


def _json(body: bytes) -> dict | None:
    """A POST body's JSON object, or None."""
    try:
        said = json.loads(body)
    except ValueError:
        return None
    return said if isinstance(said, dict) else None


def held_bytes(server: Server) -> int:
    """What a model's server holds: its weights and its slots' state (the cache), in bytes."""
    import jax

    leaves = jax.tree.leaves((server.parser.model.params, server.scheduler.slots.state))
    return sum(leaf.nbytes for leaf in leaves)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
