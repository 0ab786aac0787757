"""Flags shared by the commands that generate (`run`, `chat`), so each reads and behaves the same."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from jaxinfer import defaults
from jaxinfer.cli import render
from jaxinfer.models import DEFAULT as DEFAULT_MODEL

# The library's parameters as this CLI's flags: its errors name parameters (`JaxinferError.names`),
# and the terminal shows the flag a user typed.
FLAGS = {
    "max_tokens": "--max-tokens",
    "max_context": "--max-context",
    "prefill_chunk": "--prefill-chunk",
    "speculate": "--speculate",
    "num_draft": "--num-draft",
    "draft_model": "--draft-model",
    "gguf_file": "--gguf-file",
    "dtype": "--dtype",
    "quantize": "--quantize",
    "kv_dtype": "--kv-dtype",
    "devices": "--devices",
    "coordinator": "--coordinator",
    "num_processes": "--num-processes",
    "process_id": "--process-id",
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logprobs": "--logprobs",
    "ignore_eos": "--ignore-eos",
    "echo": "--echo",
    "logit_bias": "--logit-bias",
    "json_schema": "--json-schema",
    "json_object": "--json-object",
    "regex": "--regex",
    "choice": "--choice",
    "grammar": "--grammar-file",
    "stride": "--stride",
    "on_full": "--on-full",
    "peak_flops": "--peak-flops",
    "peak_bandwidth": "--peak-bandwidth",
    "resume": "--resume",
    "reset": "/reset",  # chat's command
    "reasoning_effort": "--reasoning-effort",
    "reasoning_format": "--reasoning-format",
    "reasoning_budget": "--reasoning-budget",
    "reasoning_budget_message": "--reasoning-budget-message",
    "keep_alive": "--keep-alive",
    "chat_template_kwargs": "--chat-template-kwargs",
    "chat_template": "--chat-template-file",
    "truncate": "--truncate",  # embed's
    "dimensions": "--dimensions",
    "prompt_name": "--prompt-name",
    "models_dir": "--models-dir",
    "stop": "--stop",
    # request fields with no flag (batch lines, the server's bodies): said as they are
    "tools": "tools",
    "tool_choice": "tool_choice",
    "functions": "functions",
    "function_call": "function_call",
    "continue_final_message": "continue_final_message",
    "add_generation_prompt": "add_generation_prompt",
    "web_search_options": "web_search_options",
    "audio": "audio",
    "min_tokens": "min_tokens",
    "thinking": "thinking",
    "n": "n",
    "stream": "stream",
    "stream_options": "stream_options",
    "input": "input",  # embeddings'
    "encoding_format": "encoding_format",
    "suffix": "suffix",  # fill-in-the-middle's
    "input_extra": "input_extra",
    "input_prefix": "input_prefix",
    "prompt": "prompt",
}

MODEL = typer.Option(
    None,
    "--model",
    "-m",
    help="Hugging Face model directory, hub id (org/name), GGUF file, or a converted model "
    f"[default: the bundled {DEFAULT_MODEL}].",
)
GGUF_FILE = typer.Option(
    None,
    "--gguf-file",
    metavar="NAME",
    show_default=False,
    help="With a hub id: run that repository's GGUF file NAME (from the hub cache, else downloaded) instead of its "
    "safetensors.",
)
TEMP = typer.Option(None, "--temp", "--temperature", help="Sampling temperature; 0 is greedy [default: the model's].")
TOP_K = typer.Option(None, "--top-k", help="Keep the k most likely tokens; 0 is off.")
TOP_P = typer.Option(None, "--top-p", help="Keep the smallest set of tokens whose probability reaches p.")
MIN_P = typer.Option(None, "--min-p", help="Drop tokens less likely than min-p × the most likely one.")
REPEAT_PENALTY = typer.Option(
    None, "--repeat-penalty", "--repetition-penalty", help="Penalise tokens already present (1 is off)."
)
PRESENCE_PENALTY = typer.Option(
    None, "--presence-penalty", help="Subtract this from a token's logit once it was generated (OpenAI's; 0 is off)."
)
FREQUENCY_PENALTY = typer.Option(
    None, "--frequency-penalty", help="Subtract this × the times a token was generated (OpenAI's; 0 is off)."
)
SEED = typer.Option(
    None, "--seed", "-s", help="Random seed; the same seed gives the same output [default: random, reported]."
)
MAX_CONTEXT = typer.Option(
    None,
    "--max-context",
    "--ctx-size",
    "-c",
    help=f"KV cache length in tokens [default: min(model's max positions, {defaults.MAX_CONTEXT})].",
)
PEAK_FLOPS = typer.Option(
    None,
    "--peak-flops",
    help="Peak FLOP/s to measure MFU against (e.g. a datasheet figure) [default: measured once per machine].",
)
PEAK_BANDWIDTH = typer.Option(
    None, "--peak-bandwidth", help="Peak memory bandwidth in bytes/s for MBU [default: measured once per machine]."
)
PREFILL_CHUNK = typer.Option(
    None,
    "--prefill-chunk",
    metavar="N",
    show_default=False,
    help="Prompt tokens per prefill call, a power of two (others round down); 0 = the whole prompt in one call. "
    "Bounds prefill memory, and lets a batch's running rows keep streaming while a long prompt is admitted "
    "[default: 512 where the CPU attention kernel runs, 128 elsewhere on the CPU, 4096 on a GPU].",
)
LOGIT_BIAS = typer.Option(
    [],
    "--logit-bias",
    "-l",
    metavar="ID±BIAS",
    help="Add BIAS to token ID's logit at every step, as llama.cpp's: 15043+1, 15043-2.5; 15043-inf never samples "
    "it (repeatable).",
)
STOP = typer.Option([], "--stop", help="Stop at this text (repeatable; escapes such as \\n work); it is not printed.")
JSON_SCHEMA = typer.Option(
    None,
    "--json-schema",
    "-j",
    metavar="FILE|JSON",
    show_default=False,
    help="Output JSON that validates against this schema (a file, or the schema itself), valid by construction "
    "(llama.cpp's -j).",
)
JSON_OBJECT = typer.Option(
    False, "--json-object", help="Output one JSON object, any (OpenAI's response_format json_object)."
)
REGEX = typer.Option(None, "--regex", metavar="PATTERN", show_default=False, help="Output text that matches PATTERN.")
CHOICE = typer.Option(
    None, "--choice", metavar="A,B,...", show_default=False, help="Output exactly one of these comma-separated choices."
)
GRAMMAR = typer.Option(
    None,
    "--grammar-file",
    "--grammar",
    metavar="FILE",
    show_default=False,
    help="Output text of this grammar: llama.cpp's GBNF (root ::= ...) or Lark (start: ...).",
)
LOGPROBS = typer.Option(
    None,
    "--logprobs",
    metavar="N",
    show_default=False,
    help="Each token's log-probability and the N most likely alternatives (0-20), under the distribution it was "
    "drawn from (after --repeat-penalty and --temp; before top-k/top-p/min-p cut it): in --json's record, else "
    "as a table on stderr.",
)
ECHO = typer.Option(
    False,
    "--echo",
    help="With --logprobs N: the prompt's tokens' log-probabilities and alternatives too (prompt_logprobs in "
    "--json; the first token has none), under the model's own distribution, as perplexity scores a text.",
)
IGNORE_EOS = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence tokens (for benchmarks).")
SYSTEM = typer.Option(
    None,
    "--system-prompt",
    "--system",
    "-sys",
    help="System prompt (llama.cpp's -sys, mlx-lm's --system-prompt); with run, the prompt goes through the "
    "model's chat template as one user turn.",
)
REASONING_EFFORT = typer.Option(
    None,
    "--reasoning-effort",
    help="low, medium or high: how long gpt-oss reasons before it answers (its chat template's "
    "reasoning_effort, OpenAI's field) [default: the template's, medium].",
)
REASONING_FORMAT = typer.Option(
    "auto",
    "--reasoning-format",
    metavar="auto|none",
    help="A thinking model's reasoning (Qwen3's and DeepSeek-R1's <think>, gpt-oss's analysis): auto reads it apart "
    "from the answer (dim on a terminal, `reasoning` in JSON, reasoning_content in the API), none leaves it in the "
    "text (llama.cpp's flag).",
)
REASONING_BUDGET = typer.Option(
    -1,
    "--reasoning-budget",
    metavar="N",
    help="-1: a thinking model thinks as it will; 0: it does not (its template's enable_thinking off, else an "
    "empty thinking block); N: its thinking block is closed after N tokens, and it answers. As llama.cpp's.",
)
REASONING_BUDGET_MESSAGE = typer.Option(
    "",
    "--reasoning-budget-message",
    metavar="TEXT",
    help='Written before the closing marker where --reasoning-budget ends a thinking block ("... time to answer."), '
    "as llama.cpp's.",
)
CHAT_TEMPLATE_FILE = typer.Option(
    None,
    "--chat-template-file",
    metavar="FILE",
    show_default=False,
    help="Render chats with this Jinja chat template instead of the model's own (llama.cpp's flag).",
)
CHAT_TEMPLATE_KWARGS = typer.Option(
    None,
    "--chat-template-kwargs",
    metavar="JSON",
    help="More variables for the chat template, a JSON object: '{\"enable_thinking\": false}' (llama-server's "
    "flag; a request's chat_template_kwargs add to them).",
)
ESCAPE = typer.Option(
    True,
    "--escape/--no-escape",
    "-e",
    help="Read \\n, \\t, \\r, \\\\, \\' and \\\" in a typed prompt as llama.cpp's -e does (--stop always reads them).",
)
QUANTIZE = typer.Option(
    None,
    "--quantize",
    "-q",
    metavar="int8|int4|q8_0|q4_0",
    show_default=False,
    help="Quantize the weight matrices as they load, in blocks of 32: int8 or int4 (as llama.cpp's q8_0 and q4_0, "
    "bfloat16 scales), or q8_0 / q4_0 (llama.cpp's own bits, float16 scales). Decode reads 3.8× (8 bits) or 7× "
    "(4 bits) fewer bytes than float32. A model converted with --quantize, or a quantized GGUF file, needs no flag.",
)
KV_DTYPE = typer.Option(
    None,
    "--kv-dtype",
    metavar="auto|bfloat16|int8",
    show_default=False,
    help="KV cache storage: auto (the compute dtype: float32 on a CPU), bfloat16 (half float32's bytes, as llama.cpp's "
    "f16 cache) or int8 (a scale per position and head: 3.8× the context of float32 fits) [default: auto].",
)
SPECULATE = typer.Option(
    None,
    "--speculate",
    metavar="ngram",
    show_default=False,
    help="Speculative decoding: ngram drafts the next tokens from the text so far (prompt lookup) and checks them in "
    "one pass "
    "over the weights; the output is exactly what plain decoding gives. Pays on text that repeats itself (code edits, "
    "quotes).",
)
NUM_DRAFT = typer.Option(
    None,
    "--num-draft",
    "--draft-max",
    "--num-draft-tokens",
    metavar="K",
    show_default=False,
    help=f"Tokens drafted per step with --speculate or --draft-model [default: {defaults.NUM_DRAFT}].",
)
DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    "--model-draft",
    metavar="DIR",
    show_default=False,
    help="Speculative decoding with a small model that shares the tokenizer: it drafts the next tokens, the model "
    "checks them "
    "in one pass; the output is exactly what plain decoding gives. Loaded with the same --dtype, --quantize and "
    "--kv-dtype.",
)
DEVICES = typer.Option(
    None,
    "--devices",
    metavar="N",
    show_default=False,
    help="Devices to spread the model over (tensor parallel: attention heads, the MLP and the vocabulary split, the KV "
    "cache by kv heads) "
    "[default: 1 on the CPU, every local GPU/TPU otherwise]. On the CPU, N devices share the same cores: a way to "
    "test, not a speed-up.",
)
_PROCESSES = "Multi-process (jax.distributed: one mesh over several processes or hosts)"
COORDINATOR = typer.Option(
    None,
    "--coordinator",
    metavar="HOST:PORT",
    show_default=False,
    envvar="JAX_COORDINATOR_ADDRESS",
    rich_help_panel=_PROCESSES,
    help="Join other jaxinfer processes started with the same flags into one mesh: process 0 listens at this address, "
    "reads the input and prints; the others hold their share of the model and stay quiet.",
)
NUM_PROCESSES = typer.Option(
    None,
    "--num-processes",
    metavar="P",
    show_default=False,
    rich_help_panel=_PROCESSES,
    help="How many processes join [default: what SLURM or Open MPI set]. --devices counts all of theirs (an equal "
    "share each).",
)
PROCESS_ID = typer.Option(
    None,
    "--process-id",
    metavar="I",
    show_default=False,
    rich_help_panel=_PROCESSES,
    help="This process's number, 0 to P-1 [default: SLURM's or Open MPI's].",
)
JOIN_TIMEOUT = typer.Option(
    None,
    "--join-timeout",
    metavar="SECONDS",
    show_default=False,
    rich_help_panel=_PROCESSES,
    help="How long to wait for every process to join before giving up [default: 120].",
)
DTYPE = typer.Option(
    "auto", "--dtype", help="Weight dtype: auto (the checkpoint's; float32 on CPU), float32, bfloat16, float16."
)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def unescape(text: str) -> str:
    """llama.cpp's escapes; a backslash before anything else stays as typed."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def worded(error) -> str:
    """A library error's message in the CLI's words (its flags for the parameters it names)."""
    return error.worded(FLAGS)


def read_prompt(argument: Optional[str], option: Optional[str], file: Optional[Path], escape: bool) -> str:
    """The prompt from PROMPT, -p or -f (one of them), or stdin; escapes read in typed text only."""
    from jaxinfer.errors import JaxinferError

    if sum(x is not None for x in (argument, option, file)) > 1:
        raise JaxinferError("give the prompt once: as PROMPT, -p/--prompt or -f/--file")
    text = argument if argument is not None else option
    if text == "-" or str(file) == "-" or (text is None and file is None and not sys.stdin.isatty()):
        return sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")  # the tokenizer names bad bytes
    if file is not None:
        try:
            return file.read_bytes().decode("utf-8", errors="surrogateescape")
        except OSError as e:
            raise JaxinferError(f"cannot read {file}: {e.strerror}") from None
    if text is None:
        raise JaxinferError("give a prompt (PROMPT, -p or -f FILE), or '-' to read it from stdin")
    return unescape(text) if escape else text


def constraint(
    json_schema: Optional[str], json_object: bool, regex: Optional[str], choice: Optional[str], grammar: Optional[Path]
):
    """The output constraint the flags give (`jaxinfer.constrain`), its files read and checked
    before any weights are."""
    from jaxinfer import constrain
    from jaxinfer.errors import JaxinferError

    def read(path: Path, flag: str) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise JaxinferError(f"{flag} {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None

    if json_schema is not None and not json_schema.lstrip().startswith("{"):
        json_schema = read(Path(json_schema), "--json-schema")
    return constrain.from_flags(
        json_schema,
        json_object,
        regex,
        None if choice is None else choice.split(","),
        None if grammar is None else read(grammar, "--grammar-file"),
    )


def chat_options(
    reasoning_format: str,
    reasoning_budget: int,
    chat_template_kwargs: Optional[str],
    reasoning_budget_message: str,
):
    """The chat flags as `chat_template.ChatOptions`."""
    import json

    from jaxinfer.chat_template import ChatOptions
    from jaxinfer.errors import JaxinferError

    try:
        kwargs = {} if chat_template_kwargs is None else json.loads(chat_template_kwargs)
    except ValueError as e:
        raise JaxinferError(f"chat_template_kwargs is not JSON ({e})", "chat_template_kwargs") from None
    return ChatOptions(kwargs, reasoning_format, reasoning_budget, reasoning_budget_message)


def check_positive(**flags: Optional[int]) -> None:
    """Before loading weights, so a bad flag fails before a multi-GB load."""
    from jaxinfer.errors import JaxinferError

    for name, value in flags.items():
        if value is not None and value < 1:
            raise JaxinferError(f"--{name.replace('_', '-')} must be at least 1")


def mesh(
    devices: Optional[int],
    coordinator: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    join_timeout: Optional[float] = None,
):
    """`--devices` as a mesh (None for one device), over the processes the multi-process flags join;
    a process other than the first prints nothing but errors from here on. First thing in a command:
    on the CPU, the number of devices is fixed when JAX starts."""
    import jax

    from jaxinfer.errors import JaxinferError
    from jaxinfer.processes import JOIN_TIMEOUT_S, join
    from jaxinfer.sharding import check_share, device_mesh

    check_positive(devices=devices, num_processes=num_processes)
    if process_id is not None and process_id < 0:
        raise JaxinferError("--process-id must be 0 or more")
    if join_timeout is not None and join_timeout <= 0:
        raise JaxinferError("--join-timeout must be positive")
    if coordinator is None and num_processes is None and process_id is None:
        return device_mesh(devices)
    check_share(devices, num_processes)  # before waiting for the others
    render.keep_stdout_for_results()  # gloo prints its connections on stdout
    mesh = device_mesh(devices, join(coordinator, num_processes, process_id, join_timeout or JOIN_TIMEOUT_S))
    if jax.process_index() != 0:
        render.follow()
    return mesh


# The flags every command that loads a model passes to `open_model`: each flag's parameter in a
# command is named as the library's, so `model_flags(locals())` gathers them.
MODEL_FLAGS = (
    "dtype",
    "quantize",
    "kv_dtype",
    "max_context",
    "prefill_chunk",
    "speculate",
    "num_draft",
    "draft_model",
    "gguf_file",
    "chat_template_file",
)


def model_flags(given: dict) -> dict:
    """Of a command's parameters (its `locals()`), those `open_model` takes."""
    return {name: given[name] for name in MODEL_FLAGS if name in given}


def open_model(model: Optional[Path], generates: bool = True, **params):
    """`jaxinfer.loading.open_model(model, **params)` with a progress bar (and `_warn_past_training`'s
    warning, and the family's note on what of the checkpoint is not run); an embedding model refused
    where the command `generates`."""
    from jaxinfer.errors import JaxinferError
    from jaxinfer.families import note
    from jaxinfer.loading import open_model

    if (path := params.pop("chat_template_file", None)) is not None:
        try:
            params["chat_template"] = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise JaxinferError(f"cannot read the chat template {path}: {getattr(e, 'strerror', None) or e}") from None
    with render.progress("loading weights") as progress:
        opened = open_model(model, progress=progress, **params)
    if generates:
        opened.model.check_generates()
    _warn_past_training(opened.model.max_positions, params.get("max_context"))
    if said := note(opened.model.config):
        render.notice(f"note: {said}")
    return opened


def context(max_positions: int, max_context: Optional[int]) -> int:
    """`-c` as the cache length (`jaxinfer.loading.context_length`), with `_warn_past_training`'s warning."""
    from jaxinfer.loading import context_length

    _warn_past_training(max_positions, max_context)
    return context_length(max_positions, max_context)


def _warn_past_training(max_positions: int, max_context: Optional[int]) -> None:
    if max_context and max_context > max_positions:
        render.notice(
            f"warning: -c {max_context} is beyond the {max_positions} positions the model was trained on; expect "
            "worse text past them"
        )


# A command's sampling flags (its parameters' names, `temp` as llama.cpp's flag) → `Sampling`'s fields.
SAMPLING_FLAGS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def logit_bias(given: list[str]) -> dict[int, float] | None:
    """`--logit-bias ID±BIAS`s as `logit_bias` (token ids are checked against the model's vocabulary
    when it runs)."""
    import re

    from jaxinfer.errors import JaxinferError

    bias = {}
    for item in given:
        found = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)\s*", item)
        if found is None or found.group(2) + found.group(3) == "+inf":
            raise JaxinferError(
                f"--logit-bias {item!r}: give a token id and a signed bias, such as 15043+1 or 15043-inf"
            )
        bias[int(found.group(1))] = float(found.group(2) + found.group(3))
    return bias or None


def sampling(loaded, given: dict):
    """The model's generation_config.json defaults, with the sampling flags of a command's
    parameters (its `locals()`) that were given on top."""
    flags = {field: given[name] for name, field in SAMPLING_FLAGS.items() if given.get(name) is not None}
    return replace(loaded.sampling, **flags)


def ceilings(dtype: str, peak_flops: Optional[float], peak_bandwidth: Optional[float], remeasure: bool = False):
    """This machine's peaks for dtype: the flags where given, else measured (the first time, or
    again with `remeasure`, with a notice)."""
    from jaxinfer.ceilings import machine_ceilings

    def announce():
        render.notice(f"measuring this machine's peak FLOP/s and memory bandwidth{'' if remeasure else ' (once)'}…")

    return machine_ceilings(dtype, peak_flops, peak_bandwidth, announce, remeasure)


def roofline(loaded, timings, peak_flops: Optional[float], peak_bandwidth: Optional[float]) -> dict:
    """Both phases of a generation against this machine's peaks."""
    from jaxinfer.roofline import Storage, generation_report

    roofs = ceilings(loaded.roofed_in, peak_flops, peak_bandwidth)
    return generation_report(loaded.config, Storage.of_params(loaded.params), timings, roofs)
