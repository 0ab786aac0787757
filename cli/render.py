"""All terminal output: the only module that imports rich. Results go to stdout, chatter to stderr."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    if err.is_terminal:
        err.print(f"[bold red]error:[/] {message}", markup=True)
    else:
        print(f"error: {message}", file=sys.stderr)


def notice(message: str) -> None:
    err.print(message, style="dim", markup=False)


def stream(pieces: Iterable[str]) -> None:
    """Print text pieces as they come: through rich on a terminal, plain and flushed when piped."""
    for piece in pieces:
        if out.is_terminal:
            out.print(piece, end="", markup=False)
        else:
            sys.stdout.write(piece)
            sys.stdout.flush()


def end_stream() -> None:
    if out.is_terminal:
        out.print()
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()


def print_json(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@contextmanager
def progress(description: str) -> Iterator:
    """A progress bar on stderr (a terminal only); yields a callback (done, total)."""
    if not err.is_terminal:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def stats(result: dict) -> None:
    """The per-phase figures of one generation, on stderr."""
    t = result["timings"]
    itl = t["itl_ms"]
    cache = {"hit": "cache hit", "miss": "compiled", "none": "already compiled"}[t["compile_cache"]]
    err.print(
        f"prefill: {result['prompt_tokens']} tokens, TTFT {t['ttft_s'] * 1000:.1f} ms, "
        f"{t['prefill_tok_s']:.1f} tok/s\n"
        f"decode:  {result['generated_tokens']} tokens, {t['decode_tok_s']:.1f} tok/s, "
        f"ITL mean {itl['mean']:.2f} / p50 {itl['p50']:.2f} / p90 {itl['p90']:.2f} ms\n"
        f"compile: {t['compile_s']:.2f} s ({cache}); finish: {result['finish_reason']}; seed: {result['seed']}",
        style="dim",
        markup=False,
    )
