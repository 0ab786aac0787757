"""`jaxinfer chat`: the interactive loop. Turns, cache reuse and transcripts live in jaxinfer.chat;
this module reads lines, runs commands and hands output to `cli.render`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from jaxinfer.cli import options, render

HELP = """commands:
  /help               this list
  /reset, /clear      forget the conversation (the system prompt stays)
  /system TEXT        set the system prompt (empty: none)
  /stats              context used and the last turn's figures
  /save FILE          write the conversation as JSON (/save! FILE replaces an existing file)
  /load FILE          read a conversation saved by /save
  /exit, /bye         leave (Ctrl-D does too)
a line of \"\"\" opens a multi-line message, and another closes it; a line starting with // is sent
with one / (a path, /usr/..., goes as it is); Ctrl-C stops a reply"""


def chat(
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    system: Optional[str] = options.SYSTEM,
    reasoning_effort: Optional[str] = options.REASONING_EFFORT,
    reasoning_format: str = options.REASONING_FORMAT,
    reasoning_budget: int = options.REASONING_BUDGET,
    reasoning_budget_message: str = options.REASONING_BUDGET_MESSAGE,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    chat_template_file: Optional[Path] = options.CHAT_TEMPLATE_FILE,
    max_tokens: Optional[int] = typer.Option(
        None,
        "--max-tokens",
        "--n-predict",
        "-n",
        help="Tokens per reply at most [default: generation_config.json's, else 512; at most half the context].",
    ),
    temp: Optional[float] = options.TEMP,
    top_k: Optional[int] = options.TOP_K,
    top_p: Optional[float] = options.TOP_P,
    min_p: Optional[float] = options.MIN_P,
    repeat_penalty: Optional[float] = options.REPEAT_PENALTY,
    presence_penalty: Optional[float] = options.PRESENCE_PENALTY,
    frequency_penalty: Optional[float] = options.FREQUENCY_PENALTY,
    logit_bias: list[str] = options.LOGIT_BIAS,
    seed: Optional[int] = options.SEED,
    stop: list[str] = options.STOP,
    ignore_eos: bool = options.IGNORE_EOS,
    json_schema: Optional[str] = options.JSON_SCHEMA,
    json_object: bool = options.JSON_OBJECT,
    regex: Optional[str] = options.REGEX,
    choice: Optional[str] = options.CHOICE,
    grammar: Optional[Path] = options.GRAMMAR,
    max_context: Optional[int] = options.MAX_CONTEXT,
    prefill_chunk: Optional[int] = options.PREFILL_CHUNK,
    speculate: Optional[str] = options.SPECULATE,
    num_draft: Optional[int] = options.NUM_DRAFT,
    draft_model: Optional[Path] = options.DRAFT_MODEL,
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
    kv_dtype: Optional[str] = options.KV_DTYPE,
    devices: Optional[int] = options.DEVICES,
    coordinator: Optional[str] = options.COORDINATOR,
    num_processes: Optional[int] = options.NUM_PROCESSES,
    process_id: Optional[int] = options.PROCESS_ID,
    join_timeout: Optional[float] = options.JOIN_TIMEOUT,
    on_full: str = typer.Option(
        "drop-oldest",
        "--on-full",
        help="When the conversation outgrows the context: drop-oldest (turns, with a notice) or error.",
    ),
) -> None:
    """Chat with the model in the terminal; each turn prefills only what is new since the last."""
    from jaxinfer.chat import ChatSession
    from jaxinfer.chat_template import FALLBACK_NOTICE
    from jaxinfer.engine import Engine
    from jaxinfer.processes import share
    from jaxinfer.text import check_stops

    options.check_positive(max_tokens=max_tokens)
    chat_flags = options.chat_options(
        reasoning_format, reasoning_budget, chat_template_kwargs, reasoning_budget_message
    )
    constraint = options.constraint(json_schema, json_object, regex, choice, grammar)
    bias = options.logit_bias(logit_bias)
    mesh = options.mesh(devices, coordinator, num_processes, process_id, join_timeout)
    opened = options.open_model(model, mesh=mesh, **options.model_flags(locals()))
    loaded, context = opened.model, opened.context
    engine = Engine(loaded.config, loaded.params, context, loaded.eos_ids, opened.decoding)
    sampling = options.sampling(loaded, locals())
    budget = max_tokens or min(loaded.max_new_tokens or 512, max(1, context // 2))
    session = ChatSession(
        loaded,
        engine,
        sampling,
        budget,
        system,
        on_full,
        seed,
        check_stops(map(options.unescape, stop)),
        ignore_eos,
        constraint,
        bias,
        reasoning_effort,
        chat_flags,
    )
    if session.template.is_fallback:
        render.notice(FALLBACK_NOTICE)
    render.notice(f"chatting with {loaded.path.name} (context {context} tokens); /help for commands, Ctrl-D to leave")
    last: dict | None = None
    while True:
        try:
            line = share(_read_message)  # the first process's terminal speaks for all
        except (EOFError, KeyboardInterrupt):
            render.end_stream()
            return
        if not line.strip():
            continue
        if line.startswith("//"):  # a message that begins with "/"
            line = line[1:]
        elif re.fullmatch(r"/[\w!]+", line.split()[0]):  # a command; a path (/usr/bin/...) is a message
            if not _command(session, line, last):
                return
            continue
        last = _turn(session, line) or last


def _read_message() -> str:
    line = render.ask(">>> ")
    if line.strip() != '"""':
        return line
    lines = []
    while (line := render.ask("... ")).strip() != '"""':
        lines.append(line)
    return "\n".join(lines)


def _turn(session, text: str) -> dict | None:
    from jaxinfer.errors import JaxinferError

    try:
        gen, notices = session.ask(text)
    except JaxinferError as e:
        render.error(options.worded(e))
        return None
    for notice in notices:
        render.notice(notice)
    try:
        render.stream(gen, session.reading)
    except KeyboardInterrupt:
        gen.interrupt()
    render.end_stream()
    session.record(gen)
    result = gen.result()
    render.unfinished(result)
    render.turn_stats(result, session.context_used, session.engine.max_context)
    return result


def _command(session, line: str, last: dict | None) -> bool:
    """Run one /command; False means leave."""
    from jaxinfer.errors import JaxinferError
    from jaxinfer.processes import share

    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/bye"):
            return False
        elif name == "/help":
            render.notice(HELP)
        elif name in ("/reset", "/clear"):
            session.reset()
            render.notice("conversation cleared")
        elif name == "/system":
            session.system = arg or None
            render.notice(f"system prompt {'set' if arg else 'removed'}")
        elif name == "/stats":
            render.notice(
                f"{len(session.messages)} messages, context {session.context_used} / {session.engine.max_context} "
                "tokens"
            )
            if last:
                render.turn_stats(last, session.context_used, session.engine.max_context)
        elif name in ("/save", "/save!", "/load") and not arg:
            render.error(f"{name} needs a file name")
        elif name == "/save" and share(Path(arg).exists):
            render.error(f"{arg} exists: /save! {arg} replaces it")
        elif name in ("/save", "/save!"):
            session.save(Path(arg))
            render.notice(f"saved {len(session.messages)} messages to {arg}")
        elif name == "/load":
            session.load(Path(arg))
            render.notice(f"loaded {len(session.messages)} messages from {arg}")
        else:
            render.error(f"unknown command {name}; /help lists them (// at the start sends a line as it is)")
    except JaxinferError as e:
        render.error(options.worded(e))
    return True
