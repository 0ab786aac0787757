"""The `jaxinfer` command: parses flags, calls the library, hands output to `cli.render`."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from jaxinfer import defaults
from jaxinfer.cli import batch, chat, embed, options, render, serve, tools

app = typer.Typer(
    help="Run Llama-family language models on JAX: compiled prefill, on-device decode loop.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXAMPLES = {
    "run": [
        'jaxinfer run "def fibonacci(n):"',
        'jaxinfer run -m path/to/hf-model -p "The capital of France is" -n 64 --temp 0',
        "cat notes.txt | jaxinfer run -m path/to/hf-model - --json",
    ],
    "chat": [
        "jaxinfer chat -m path/to/instruct-model",
        'jaxinfer chat -m path/to/instruct-model --system "Be brief." --temp 0.7',
    ],
    "batch": [
        "jaxinfer batch requests.jsonl -o results.jsonl -b 16",
        "jaxinfer batch requests.jsonl -o results.jsonl --resume",
        "cat requests.jsonl | jaxinfer batch - > results.jsonl",
    ],
    "serve": [
        "jaxinfer serve -m path/to/instruct-model --port 8000 -b 16",
        "jaxinfer serve -m path/to/instruct-model --api-key KEY -b 32 -c 8192 --quantize int8",
    ],
    "embed": [
        'jaxinfer embed -m path/to/Qwen3-Embedding-0.6B "What is the capital of France?" --prompt-name query',
        "jaxinfer embed -m path/to/embedding-model -f passages.txt > vectors.jsonl",
    ],
    "list": ["jaxinfer list", "jaxinfer list --models-dir ~/models --json"],
    "convert": ["jaxinfer convert path/to/hf-model path/to/converted", 'jaxinfer run -m path/to/converted "Hello"'],
    "info": ["jaxinfer info -m path/to/hf-model", "jaxinfer info -m path/to/hf-model -c 32768 -b 8 --json"],
    "perplexity": [
        "jaxinfer perplexity -m path/to/hf-model wiki.test.raw -c 512",
        "jaxinfer perplexity -m path/to/hf-model notes.txt --quantize int4 --kl --json",
    ],
    "bench": ["jaxinfer bench -m path/to/hf-model -p 128,512 -b 1,8", "jaxinfer bench -p 64 -n 64 -b 1,16 -r 3 --json"],
}


def _epilog(command: str) -> str:
    # \b keeps click from rewrapping the lines
    return "\b\nExamples:\n" + "\n".join("  " + line for line in EXAMPLES[command])


_debug = os.environ.get("JAXINFER_DEBUG", "") not in ("", "0")
# accepted after the command too
GLOBAL_WITH_VALUE = ("--compile-cache", "--threads", "-t", "--n-gpu-layers", "--gpu-layers", "-ngl")
GLOBAL_FLAGS = ("--debug", "--verbose", "--color", "--no-color", *GLOBAL_WITH_VALUE)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"jaxinfer {version('jaxinfer')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
    debug: bool = typer.Option(
        False,
        "--debug",
        "--verbose",
        help="Show full tracebacks on errors (anywhere on the line; or JAXINFER_DEBUG=1).",
    ),
    color: Optional[bool] = typer.Option(
        None,
        "--color/--no-color",
        help="Colour the chatter on stderr even when it is not a terminal, or never [default: on a terminal, unless "
        "NO_COLOR is set].",
    ),
    gpu_layers: Optional[str] = typer.Option(
        None,
        "--n-gpu-layers",
        "--gpu-layers",
        "-ngl",
        metavar="N",
        help="llama.cpp's: accepted and ignored, with a note. Every layer runs where JAX runs: on an NVIDIA GPU when "
        "jax[cuda12] or jax[cuda13] is installed and one is there; --devices N spreads a model over N of them.",
    ),
    threads: Optional[int] = typer.Option(
        None,
        "--threads",
        "-t",
        help="CPU cores XLA may use (llama.cpp's -t): the process is pinned to that many [default: all].",
    ),
    compile_cache: Optional[str] = typer.Option(
        None,
        "--compile-cache",
        metavar="DIR",
        help="Persistent XLA compilation cache (default: $JAXINFER_CACHE_DIR or ~/.cache/jaxinfer/xla; '' turns it "
        "off).",
    ),
) -> None:
    global _debug
    _debug = _debug or debug
    render.colors(color)
    if gpu_layers is not None:
        render.notice(
            f"note: -ngl {gpu_layers} does not apply: every layer runs where JAX runs (an NVIDIA GPU with jax[cuda12] "
            "or jax[cuda13] installed; --devices N spreads a model over N devices)"
        )
    from jaxinfer.runtime import check_backend, enable_compilation_cache

    if threads is not None:
        _pin_to_cores(threads)
    if os.environ.get("JAX_PLATFORMS"):  # the only way to ask for a backend that is not there
        check_backend()
    try:
        enable_compilation_cache(compile_cache)
    except OSError as e:  # optional: a read-only home must not stop anything
        render.notice(f"warning: no compile cache ({e.filename}: {e.strerror}); programs are compiled on every run")


def _names_a_directory(text: str) -> bool:
    try:
        return Path(text).is_dir()
    except OSError:  # a prompt longer than a path may be
        return False


@app.command(epilog=_epilog("run"))
def run(
    prompt: Optional[str] = typer.Argument(None, help="Text to continue; '-' reads stdin."),
    prompt_option: Optional[str] = typer.Option(
        None, "--prompt", "-p", help="The prompt, as llama.cpp and mlx-lm take it."
    ),
    prompt_file: Optional[Path] = typer.Option(
        None, "--file", "-f", help="Read the prompt from this file ('-': stdin)."
    ),
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
        help=f"Tokens to generate at most [default: generation_config.json's, else {defaults.MAX_TOKENS}].",
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
    logprobs: Optional[int] = options.LOGPROBS,
    echo: bool = options.ECHO,
    json_schema: Optional[str] = options.JSON_SCHEMA,
    json_object: bool = options.JSON_OBJECT,
    regex: Optional[str] = options.REGEX,
    choice: Optional[str] = options.CHOICE,
    grammar: Optional[Path] = options.GRAMMAR,
    escape: bool = options.ESCAPE,
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
    json_output: bool = typer.Option(
        False, "--json", help="Print one JSON object on stdout instead of streaming text."
    ),
    show_stats: bool = typer.Option(
        True, "--stats/--no-stats", help="Per-phase timings and roofline (MFU, MBU) on stderr."
    ),
    peak_flops: Optional[float] = options.PEAK_FLOPS,
    peak_bandwidth: Optional[float] = options.PEAK_BANDWIDTH,
) -> None:
    """Generate a continuation of PROMPT, streamed to stdout."""
    from jaxinfer.buckets import check_text_fits
    from jaxinfer.ceilings import check_peaks
    from jaxinfer.chat_template import FALLBACK_NOTICE, ChatTemplate
    from jaxinfer.engine import Engine, compile_ahead
    from jaxinfer.errors import JaxinferError
    from jaxinfer.generate import Generation
    from jaxinfer.processes import share
    from jaxinfer.replies import Reading, bounded
    from jaxinfer.runtime import check_backend
    from jaxinfer.sampling import check_logprobs
    from jaxinfer.text import check_echo, check_stops

    def read() -> str:
        if model is None and prompt and _names_a_directory(prompt):  # the ollama / llama.cpp habit
            raise JaxinferError(
                f'{prompt} is a directory, not a prompt: to run the model in it, jaxinfer run -m {prompt} "PROMPT"'
            )
        text = options.read_prompt(prompt, prompt_option, prompt_file, escape)
        if not text.strip():
            raise JaxinferError("the prompt is empty: give some text to continue")
        return text

    if reasoning_effort is not None and system is None:
        raise JaxinferError("reasoning_effort goes through the chat template: give a system prompt", "reasoning_effort")
    options.check_positive(max_tokens=max_tokens)
    chat = options.chat_options(reasoning_format, reasoning_budget, chat_template_kwargs, reasoning_budget_message)
    check_logprobs(logprobs)
    check_echo(echo, logprobs)
    bias = options.logit_bias(logit_bias)
    constraint = options.constraint(json_schema, json_object, regex, choice, grammar)
    check_peaks(peak_flops, peak_bandwidth)  # before the weights are read
    mesh = options.mesh(devices, coordinator, num_processes, process_id, join_timeout)
    text = share(read)  # the first process reads it (its stdin, its files)
    # On an accelerator a plain prompt's programs compile while the weights load. Not on the CPU,
    # whose cores the load keeps busy: a 1.1B model on 2 cores loaded in 5.6-7.1 s and compiled in
    # 3.0 s apart, and together the load took 9.9-10.9 s (`engine.compile_ahead`).
    plain = system is None and logprobs is None and constraint is None and not (presence_penalty or frequency_penalty)
    plain &= bias is None
    plain &= check_backend() != "cpu"

    def ahead(opened) -> None:
        ids = opened.model.tokenizer.encode(text)
        limit = max_tokens or max(1, min(opened.model.max_new_tokens or defaults.MAX_TOKENS, opened.context - len(ids)))
        compile_ahead(opened, ids, limit)

    opened = options.open_model(model, mesh=mesh, ahead=ahead if plain else None, **options.model_flags(locals()))
    loaded, context = opened.model, opened.context
    sampling = options.sampling(loaded, locals())
    stops = check_stops(map(options.unescape, stop))
    special = system is None  # a chat turn's template writes the special tokens itself
    template = ChatTemplate.of(loaded)
    reading = Reading("harmony" if template.is_harmony else None)  # gpt-oss: reasoning apart from the answer
    thinking = None
    if system is not None:
        if template.is_fallback:
            render.notice(FALLBACK_NOTICE)
        turns = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        text, reading = template.prompt(turns, chat, reading.calls, **template.reasoning(reasoning_effort))
        thinking = bounded(
            chat.reasoning_budget, template.source, reading.opened, loaded.tokenizer, chat.reasoning_budget_message
        )
        stops += template.stop
    check_text_fits(text, loaded.tokenizer, context)
    prompt_ids = loaded.tokenizer.encode(text, add_special_tokens=special)
    if max_tokens is None:  # a default never makes a prompt that fits fail: it shrinks to the room left
        max_tokens = max(1, min(loaded.max_new_tokens or defaults.MAX_TOKENS, context - len(prompt_ids)))
    engine = Engine(loaded.config, loaded.params, context, loaded.eos_ids, opened.decoding)
    gen = Generation(
        loaded,
        engine,
        prompt_ids,
        sampling,
        max_tokens,
        seed,
        stops,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        constraint=constraint,
        echo=echo,
        logit_bias=bias,
        thinking=thinking,
    )
    try:
        if json_output:
            for _ in gen:
                pass
        else:
            render.stream(gen, reading)
    except KeyboardInterrupt:
        gen.interrupt()
    result = gen.result()
    if reading:  # the text as generated, markers kept; and read
        result["reasoning"], result["content"], result["tool_calls"] = reading.reply(result["text"])
    if not json_output:
        render.end_stream()  # before any notice the roofline may print
    render.unfinished(result)
    if result["finish_reason"] == "interrupted" and not result["generated_tokens"]:  # no phase to report
        if json_output:
            render.print_json(json.dumps(result, ensure_ascii=False))
        render.notice("interrupted before the first token (while compiling or prefilling): nothing was generated")
        raise typer.Exit(130)
    result["timings"]["kernels"] = loaded.kernels
    if show_stats:  # the roofline measures the machine's roofs on first use: not for --no-stats
        result["timings"]["roofline"] = options.roofline(loaded, gen.timings, peak_flops, peak_bandwidth)
    if json_output:
        render.print_json(json.dumps(result, ensure_ascii=False))
    if logprobs is not None and not json_output:
        render.logprobs(result["logprobs"], result.get("prompt_logprobs"))
    if show_stats:
        render.stats(result)
    if result["finish_reason"] == "interrupted":
        raise typer.Exit(130)


app.command(epilog=_epilog("chat"))(chat.chat)
app.command(epilog=_epilog("batch"))(batch.batch)
app.command(epilog=_epilog("serve"))(serve.serve)
app.command(epilog=_epilog("embed"))(embed.embed)


app.command("list", epilog=_epilog("list"))(tools.list_models)
app.command("ls", hidden=True)(tools.list_models)  # ollama's and the shell's word
app.command(epilog=_epilog("convert"))(tools.convert)
app.command(epilog=_epilog("perplexity"))(tools.perplexity)
app.command(epilog=_epilog("info"))(tools.info)
app.command(epilog=_epilog("bench"))(tools.bench)


def main() -> None:
    """Console entry point: every failure is one line on stderr and a non-zero exit code."""
    from jaxinfer.errors import JaxinferError

    _closed_streams_said_so()
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        code = app(args=_global_flags_first(sys.argv[1:]) or ["--help"], standalone_mode=False)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not in the interpreter's exit
    except JaxinferError as e:
        if _debug:
            raise
        render.error(options.worded(e))
        code = 1
    except typer.TyperException as e:  # typer's (vendored click) usage errors: bad flags and values
        render.error(e.format_message())
        code = e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        code = 130
    except OSError as e:  # what the machine refused (a full disk, a closed pipe or stream): not a bug
        code = _stream_failed(e)
    except Exception as e:  # a bug, not bad input: still one line unless --debug
        if _debug:
            raise
        render.error(f"unexpected {type(e).__name__}: {e} (run with --debug for the traceback)")
        code = 1
    if _terminated and code == 130:
        code = 128 + signal.SIGTERM  # what it was ended by; the output is the interrupt's
    sys.exit(code or 0)


_terminated = False


def _terminate_as_interrupt(signum, frame) -> None:
    """SIGTERM (kill, systemd, `timeout`) ends a command as Ctrl-C does: a batch with its summary,
    a run with what it produced. It is passed on as SIGINT, so it waits out a compile as Ctrl-C does
    (`runtime.interrupts_held`)."""
    global _terminated
    _terminated = True
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in a shell's background: end as SIGTERM does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)


class _ClosedStream(io.TextIOBase):
    """Where Python leaves None for a standard stream closed at start (`<&-`, `>&-`): using it is an
    OSError that says which stream, as a full disk is."""

    def __init__(self, name: str):
        self.name = name

    def _closed(self, *args):
        raise OSError(errno.EBADF, f"{self.name} is closed")

    read = readline = write = fileno = _closed
    buffer = property(lambda self: self)

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        pass


def _closed_streams_said_so() -> None:
    for name in ("stdin", "stdout"):
        if getattr(sys, name) is None:
            setattr(sys, name, _ClosedStream(name))


def _stream_failed(e: OSError) -> int:
    """One line for an OSError the commands do not word themselves (writing results to a full disk,
    to /dev/full, to a pipe whose reader left, to a closed stdout); a reader that left (`| head`) ends
    the run quietly with 1, as click does for the commands themselves. Records already written stay
    written."""
    if e.errno == errno.EPIPE:
        _stdout_to_devnull()
        return 1
    if not isinstance(sys.stdout, _ClosedStream):
        _stdout_to_devnull()  # what is still buffered cannot be written either
    render.error(f"cannot go on: {e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))
    return 1


def _stdout_to_devnull() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass


def _pin_to_cores(threads: int) -> None:
    """XLA CPU sizes its thread pool from the cores the process may run on, read when the backend
    starts (before any command touches JAX): pinning is how a thread count reaches it."""
    from jaxinfer.errors import JaxinferError

    if not hasattr(os, "sched_setaffinity"):
        raise JaxinferError("-t/--threads needs CPU affinity, which this platform does not offer")
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cores):
        raise JaxinferError(f"-t/--threads must be between 1 and the {len(cores)} cores this process may use")
    os.sched_setaffinity(0, cores[:threads])


# llama.cpp's flags its users type out of habit (click would read "-fa" as "-f a"): (takes a value,
# what it means here: a note where it is already so or does not apply, an error where we do not do it)
LLAMA_CPP_FLAGS = {
    ("-fa", "--flash-attn"): ("on|off|auto", "note: {flag} does not apply: attention always runs fused (our kernels)"),
    ("--jinja",): (None, "note: --jinja does not apply: chat templates are always Jinja"),
    ("--no-display-prompt",): (
        None,
        "note: --no-display-prompt does not apply: the prompt is printed only with --echo",
    ),
    ("-no-cnv", "--no-conversation"): (None, "note: {flag} does not apply: run is one prompt, chat a conversation"),
    ("-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"): (None, "chat"),
    ("--repeat-last-n",): ("N", "note: --repeat-last-n does not apply: --repeat-penalty counts the prompt and output"),
    ("--mirostat", "--mirostat-lr", "--mirostat-ent"): (
        "N",
        "error: mirostat sampling is not offered: sample with --temp, --top-p, --min-p or --top-k",
    ),
}


def _llama_cpp_flags(args: list[str]) -> list[str]:
    """`args` without llama.cpp's flags (and their values), each answered: a note, or an error."""
    from jaxinfer.errors import JaxinferError

    command = next((a for a in args if not a.startswith("-")), None)
    kept, i = [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg == "--":
            kept += args[i - 1 :]
            break
        flag, _, given = arg.partition("=")
        said = next(((value, answer) for flags, (value, answer) in LLAMA_CPP_FLAGS.items() if flag in flags), None)
        if said is None:
            kept.append(arg)
            continue
        value, answer = said
        if value and not given and i < len(args):
            optional = value == "on|off|auto"  # -fa alone is llama.cpp's older spelling
            if not optional or args[i] in ("on", "off", "auto", "1", "0"):
                given, i = args[i], i + 1
        if answer == "chat":
            if command != "chat":
                raise JaxinferError(
                    f"{flag} is llama.cpp's conversation mode: here that is `jaxinfer chat` ({command} is not)"
                )
            continue  # chat is one already
        if answer.startswith("error: ") and not (flag == "--mirostat" and given == "0"):
            raise JaxinferError(answer.removeprefix("error: "))
        if not answer.startswith("error: "):
            render.notice(answer.format(flag=flag))
    return kept


def _global_flags_first(args: list[str]) -> list[str]:
    """`jaxinfer run ... --debug` as `jaxinfer --debug run ...` (the hint on an error says
    "run with --debug" whatever the user typed before); the same for --compile-cache and -t.
    llama.cpp's flags are answered and left out first (`LLAMA_CPP_FLAGS`)."""
    args = _llama_cpp_flags(args)
    front, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        takes_value = arg in GLOBAL_WITH_VALUE and i + 1 < len(args)
        if arg in GLOBAL_FLAGS or arg.startswith(("--compile-cache=", "--threads=")):
            front += args[i : i + 1 + takes_value]
            i += takes_value
        else:
            rest.append(arg)
        i += 1
    return front + rest
