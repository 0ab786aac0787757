"""`jaxinfer batch`: reads the JSONL input, runs the job, reports progress. The job itself (parsing,
records, resume) is jaxinfer.jobs; the slots and continuous batching are jaxinfer.scheduler."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from jaxinfer import defaults
from jaxinfer.cli import options, render

MAX_EXIT_CODE = 125  # the exit code counts failed lines, capped below the codes shells reserve


def batch(
    input_path: str = typer.Argument(..., metavar="INPUT", help="JSONL requests, or '-' for stdin."),
    output_path: str = typer.Option("-", "--output", "-o", metavar="OUTPUT", help="JSONL results, or '-' for stdout."),
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Sequences decoded together (slots)."),
    max_tokens: Optional[int] = typer.Option(
        None,
        "--max-tokens",
        "--n-predict",
        "-n",
        help=f"Default tokens per request [default: generation_config.json's, else {defaults.MAX_TOKENS}, shrunk to "
        "the room each prompt leaves].",
    ),
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
    resume: bool = typer.Option(False, "--resume", help="Skip the ids OUTPUT already has, and append to it."),
    reasoning_format: str = options.REASONING_FORMAT,
    reasoning_budget: int = options.REASONING_BUDGET,
    reasoning_budget_message: str = options.REASONING_BUDGET_MESSAGE,
    chat_template_kwargs: Optional[str] = options.CHAT_TEMPLATE_KWARGS,
    chat_template_file: Optional[Path] = options.CHAT_TEMPLATE_FILE,
) -> None:
    """Run every request of a JSONL file with continuous batching; each result is written as it finishes."""
    from jaxinfer.errors import JaxinferError
    from jaxinfer.forms import layout_for_batch
    from jaxinfer.jobs import Job
    from jaxinfer.processes import share
    from jaxinfer.scheduler import Scheduler

    options.check_positive(batch_size=batch_size, max_tokens=max_tokens)
    chat = options.chat_options(reasoning_format, reasoning_budget, chat_template_kwargs, reasoning_budget_message)
    to_stdout = output_path == "-"
    if resume and to_stdout:
        raise JaxinferError("--resume needs an output file (-o FILE) to resume")
    output = Path(output_path)
    mesh = options.mesh(devices, coordinator, num_processes, process_id, join_timeout)

    def read() -> list[str]:  # in the first process only, which writes the results
        if not to_stdout and output.is_dir():
            raise JaxinferError(f"{output} is a directory: -o names the results file")
        if not to_stdout and output.exists() and not resume:
            raise JaxinferError(f"{output} exists: add --resume to continue that job, or choose another output")
        return _read_lines(input_path)

    lines = share(read)
    batch_size = min(batch_size, max(1, sum(1 for line in lines if line.strip())))  # no slot no request can fill
    layout = layout_for_batch(batch_size, mesh is not None)
    opened = options.open_model(model, layout=layout, mesh=mesh, **options.model_flags(locals()))
    loaded, context = opened.model, opened.context
    earlier = None if to_stdout else _open_output(output, resume)
    if earlier and earlier.dropped:
        render.notice(f"resuming: removed a record cut short at the end of {output}: {earlier.dropped[:60]}…")
    job = Job(
        loaded,
        context,
        max_tokens,
        earlier.file if earlier else sys.stdout,
        earlier,
        speculating=opened.decoding.speculating,
        chat=chat,
    )
    requests = list(job.requests(lines))
    if job.skipped:
        render.notice(f"resuming: {job.skipped} requests already done in {output}")
    runner = Scheduler(loaded, batch_size, context, opened.decoding)
    started = time.perf_counter()
    interrupted = False
    with render.job_progress(len(requests)) as update:

        def on_result(record: dict) -> None:
            job.write(record)
            update(runner.stats.finished, runner.stats.generated_tokens / (time.perf_counter() - started))

        try:
            runner.run(requests, on_result)
        except KeyboardInterrupt:
            interrupted = True
    seconds = time.perf_counter() - started
    render.notice(
        f"batch: {runner.stats.finished} of {len(requests)} done, {job.failed} bad lines, {job.skipped} skipped; "
        f"{runner.stats.generated_tokens} tokens in {seconds:.1f} s ({runner.stats.generated_tokens / seconds:.1f} "
        "tok/s, "
        f"compile {runner.stats.compile.seconds:.1f} s)"
    )
    if interrupted:
        raise typer.Exit(130)
    if job.failed:
        raise typer.Exit(min(job.failed, MAX_EXIT_CODE))


def _open_output(output: Path, resume: bool):
    """The results file, opened by the first process; the others write nowhere, knowing what an
    earlier run of the job left in it (they must skip the same requests)."""
    from jaxinfer.jobs import Output, open_output
    from jaxinfer.processes import share

    opened = None

    def open_first() -> Output:
        nonlocal opened
        opened = open_output(output, resume)
        return replace(opened, file=None)

    earlier = share(open_first)
    return opened or replace(earlier, file=open(os.devnull, "w"))


def _read_lines(path: str) -> list[str]:
    from jaxinfer.errors import JaxinferError
    from jaxinfer.jobs import jsonl_lines

    # Bytes that are not UTF-8 are kept as surrogates: the lines holding them become error records.
    if path == "-":
        return jsonl_lines(sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape"))
    try:
        return jsonl_lines(Path(path).read_bytes().decode("utf-8", errors="surrogateescape"))
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror}") from None
