"""`jaxinfer serve`: flags → `jaxinfer.server.Server` on uvicorn."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from jaxinfer.cli import embed, options, render


def serve(
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free one, printed)."),
    api_key: Optional[str] = typer.Option(
        None,
        "--api-key",
        envvar="JAXINFER_API_KEY",
        help="Require this key (Authorization: Bearer KEY) on every endpoint but /health.",
    ),
    batch_size: int = typer.Option(
        8, "--batch-size", "-b", "--parallel", "-np", help="Sequences decoded together (slots)."
    ),
    max_tokens: Optional[int] = typer.Option(
        None,
        "--max-tokens",
        "--n-predict",
        "-n",
        help="Default tokens per request [default: generation_config.json's, shrunk to the room each prompt leaves].",
    ),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests waiting for a slot at most; more get 429."),
    max_context: Optional[int] = options.MAX_CONTEXT,
    prefill_chunk: Optional[int] = options.PREFILL_CHUNK,
    speculate: Optional[str] = options.SPECULATE,
    num_draft: Optional[int] = options.NUM_DRAFT,
    draft_model: Optional[Path] = options.DRAFT_MODEL,
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
    kv_dtype: Optional[str] = options.KV_DTYPE,
    devices: Optional[int] = options.DEVICES,
    reasoning_format: str = options.REASONING_FORMAT,
    reasoning_budget: int = options.REASONING_BUDGET,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    chat_template_file: Optional[Path] = options.CHAT_TEMPLATE_FILE,
    pooling: Optional[str] = embed.POOLING,
) -> None:
    """Serve OpenAI's, Anthropic's and ollama's APIs to many clients at once, batched continuously."""
    import uvicorn

    from jaxinfer.api import Parser
    from jaxinfer.chat_template import FALLBACK_NOTICE, ChatTemplate
    from jaxinfer.forms import layout_for_batch
    from jaxinfer.scheduler import Scheduler
    from jaxinfer.server import INTERVAL_S, Server

    options.check_positive(batch_size=batch_size, max_tokens=max_tokens, max_queue=max_queue)
    chat = options.chat_options(reasoning_format, reasoning_budget, chat_template_kwargs)
    _check_port(host, port)  # before the model loads: a port in use is known in a moment
    mesh = options.mesh(devices)
    opened = options.open_model(
        model,
        generates=False,
        layout=layout_for_batch(batch_size, mesh is not None),
        mesh=mesh,
        **options.model_flags(locals()),
    )
    loaded, context = embed.with_pooling(opened.model, pooling), opened.context
    if loaded.config.headless:
        render.notice("note: an embedding model: /v1/embeddings and /api/embed answer, the generating endpoints refuse")
    elif ChatTemplate.of(loaded).is_fallback:  # what /v1/chat/completions renders
        render.notice(FALLBACK_NOTICE)
    server = Server(
        lambda: Scheduler(loaded, batch_size, context, opened.decoding, INTERVAL_S),
        Parser(loaded, context, max_tokens, opened.decoding.speculating, chat),
        loaded.path.name,
        api_key,
        max_queue,
    )

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: now, without uvicorn's tracebacks
                render.notice("stopped")
                sys.stderr.flush()
                os._exit(128 + sig)
            if not self.should_exit:
                running = server.scheduler.busy + len(server.inbox)
                if sig == signal.SIGINT:  # Ctrl-C: stop now, answering what was made; SIGTERM drains
                    server.cancel_all()
                render.notice(f"{'stopping' if sig == signal.SIGINT else 'draining'}: {running} requests to finish")
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                render.notice(f"serving {loaded.path.name} on http://{bound[0]}:{bound[1]}/v1 ({batch_size} slots)")

    config = uvicorn.Config(server.app(), host=host, port=port, log_level="warning", lifespan="off")
    server.start()
    try:
        _Uvicorn(config).run()
    finally:
        server.stop()


def _check_port(host: str, port: int) -> None:
    """Refuse a port that cannot be listened on (in use, not ours to take), as uvicorn would after the load."""
    import socket

    from jaxinfer.errors import JaxinferError

    if not 0 <= port <= 65535:
        raise JaxinferError("--port must be from 0 to 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise JaxinferError(f"--host {host}: {e.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise JaxinferError(f"cannot listen on {host}:{port}: {e.strerror} (--port 0 takes any free one)") from None
