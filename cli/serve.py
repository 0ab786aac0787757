"""`jaxinfer serve`: flags → `jaxinfer.server.Server` on uvicorn."""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import typer

from jaxinfer.cli import embed, options, render


def serve(
    model: Optional[list[str]] = typer.Option(
        None,
        "--model",
        "-m",
        help="Model directory, hub id, GGUF file or ollama:NAME; again for more models, each chosen by the "
        "request's model [default: the bundled model].",
    ),
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
    reasoning_budget_message: str = options.REASONING_BUDGET_MESSAGE,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    chat_template_file: Optional[Path] = options.CHAT_TEMPLATE_FILE,
    pooling: Optional[str] = embed.POOLING,
    models_dir: Optional[Path] = typer.Option(
        None, "--models-dir", help="Serve every model in DIR too (its subdirectories with a config.json, GGUF files)."
    ),
    models_max: int = typer.Option(
        2, "--models-max", help="Models held at once (the least recently used idle one is stopped for another)."
    ),
    models_memory: Optional[str] = typer.Option(
        None,
        "--models-memory",
        metavar="SIZE",
        help="Memory the models held may take together, weights and caches (24G, 512M): the least recently used "
        "idle ones are stopped for another [default: no bound but --models-max].",
    ),
    keep_alive: Optional[str] = typer.Option(
        None,
        "--keep-alive",
        metavar="DURATION",
        help="How long a model stays held after its last request (5m, 1h, 0; ollama's; a request's keep_alive says it "
        "for its model) [default: for ever].",
    ),
    alias: Optional[list[str]] = typer.Option(
        None,
        "--alias",
        "-a",
        metavar="NAME[=MODEL]",
        help="Another name requests may give a model (the first model's, or MODEL's: its served name or -m); again "
        "for more.",
    ),
) -> None:
    """Serve OpenAI's, Anthropic's and ollama's APIs to many clients at once, batched continuously."""
    import uvicorn

    from jaxinfer import ollama
    from jaxinfer.api import Parser
    from jaxinfer.chat_template import FALLBACK_NOTICE, ChatTemplate
    from jaxinfer.errors import JaxinferError
    from jaxinfer.forms import layout_for_batch
    from jaxinfer.listing import disk_bytes, models_in
    from jaxinfer.modeldir import load_config, model_directory
    from jaxinfer.router import Router
    from jaxinfer.scheduler import Scheduler
    from jaxinfer.server import INTERVAL_S, Server

    options.check_positive(batch_size=batch_size, max_tokens=max_tokens, max_queue=max_queue, models_max=models_max)
    chat = options.chat_options(reasoning_format, reasoning_budget, chat_template_kwargs, reasoning_budget_message)
    _check_port(host, port)  # before the model loads: a port in use is known in a moment
    mesh = options.mesh(devices)
    specs = [*(model or []), *(str(p) for p in (models_in(models_dir) if models_dir else []))] or [None]
    names = {_served_name(spec): spec for spec in specs}
    if len(names) < len(specs):
        raise JaxinferError("two models would be served under one name: give each once")
    flags = options.model_flags(locals())
    for spec in specs[1:]:  # each model's config read now: a bad one is said before serving, not on its first request
        load_config(spec, gguf_file)
    aliases = _aliases(alias or [], names)
    memory = None if models_memory is None else _size(models_memory)
    keep = None if keep_alive is None else ollama.keep_alive(keep_alive)
    sizes = {name: disk_bytes(model_directory(spec, gguf_file)) for name, spec in names.items()} if memory else {}

    def make(spec: Optional[str]) -> Server:
        """A model's server: its weights loaded (the first at once, the others on their first request)."""
        opened = options.open_model(
            spec, generates=False, layout=layout_for_batch(batch_size, mesh is not None), mesh=mesh, **flags
        )
        loaded, context = embed.with_pooling(opened.model, pooling), opened.context
        if loaded.config.headless:
            render.notice("note: an embedding model: /v1/embeddings and /api/embed answer, the generating ones refuse")
        elif ChatTemplate.of(loaded).is_fallback:  # what /v1/chat/completions renders
            render.notice(FALLBACK_NOTICE)
        return Server(
            lambda: Scheduler(loaded, batch_size, context, opened.decoding, INTERVAL_S),
            Parser(loaded, context, max_tokens, opened.decoding.speculating, chat),
            _served_name(spec),
            api_key,
            max_queue,
        )

    makers = {name: partial(make, spec) for name, spec in names.items()}
    server = Router(makers, models_max, api_key, aliases=aliases, memory=memory, sizes=sizes, keep_alive=keep)

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: now, without uvicorn's tracebacks
                render.notice("stopped")
                sys.stderr.flush()
                os._exit(128 + sig)
            if not self.should_exit:
                running = server.running
                if sig == signal.SIGINT:  # Ctrl-C: stop now, answering what was made; SIGTERM drains
                    server.cancel_all()
                render.notice(f"{'stopping' if sig == signal.SIGINT else 'draining'}: {running} requests to finish")
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                served = ", ".join(names)
                render.notice(f"serving {served} on http://{bound[0]}:{bound[1]}/v1 ({batch_size} slots)")

    config = uvicorn.Config(server, host=host, port=port, log_level="warning", lifespan="off")
    try:
        _Uvicorn(config).run()
    finally:
        server.stop()


def _served_name(spec: Optional[str]) -> str:
    """The name a model is served under (and requests name it by): a directory's or file's name,
    else the hub id or ollama name as given."""
    from jaxinfer.modeldir import bundled_model_dir

    if spec is None:
        return bundled_model_dir().name
    local = Path(spec).expanduser()
    return local.name if local.exists() else spec


def _aliases(given: list[str], names: dict[str, Optional[str]]) -> dict[str, str]:
    """`--alias NAME[=MODEL]` as alias → served name: MODEL a served name or a -m as given, else the first."""
    from jaxinfer.errors import JaxinferError

    aliases: dict[str, str] = {}
    for text in given:
        alias, _, model = text.partition("=")
        target = model and next((n for n, spec in names.items() if model in (n, spec)), None)
        if not alias or target is None:
            raise JaxinferError(
                f"--alias {text}: NAME, or NAME=MODEL with MODEL one of those served ({', '.join(names)})"
            )
        if alias in names or alias in aliases:
            raise JaxinferError(f"--alias {alias}: that name is taken (a model's, or an earlier alias)")
        aliases[alias] = target or next(iter(names))
    return aliases


def _size(text: str) -> int:
    """A size in bytes from 24G, 512M, 1.5T, 4096K or a number of bytes."""
    from jaxinfer.errors import JaxinferError

    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = text.strip().upper().removesuffix("IB").removesuffix("B"), ""
    if number[-1:] in units and number[-1:]:
        number, unit = number[:-1], number[-1]
    try:
        size = float(number) * units[unit]
    except ValueError:
        size = -1
    if not size > 0:
        raise JaxinferError(f"--models-memory {text}: a size such as 24G, 512M or a number of bytes")
    return int(size)


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
