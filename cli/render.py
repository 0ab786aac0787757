"""All terminal output: the only module that imports rich. Results go to stdout, chatter to stderr."""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

FOLDED_LINES = 4  # the reasoning's last lines shown on a terminal while a model thinks
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def colors(on: bool | None) -> None:
    """--color (colour even off a terminal), --no-color; None: rich's choice (a terminal, NO_COLOR)."""
    global out, err
    if on is not None:
        out = Console(highlight=False, soft_wrap=True, force_terminal=on or None, no_color=not on)
        err = Console(stderr=True, highlight=False, soft_wrap=True, force_terminal=on or None, no_color=not on)


def keep_stdout_for_results() -> None:
    """What native code prints on stdout (gloo's lines on joining processes) goes nowhere; Python's
    output goes on to the real stdout."""
    sys.stdout.flush()
    kept = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = os.fdopen(kept, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors, buffering=1)


def follow() -> None:
    """This process follows the first of a multi-process run: no output but errors."""
    out.quiet = err.quiet = True
    sys.stdout = open(os.devnull, "w")


def error(message: str) -> None:
    if err.is_terminal and not err.quiet:
        err.print(f"[bold red]error:[/] {message}", markup=True)
    else:
        print(f"error: {message}", file=sys.stderr)


def notice(message: str) -> None:
    err.print(message, style="dim", markup=False)


def unfinished(result: dict) -> None:
    """Say so where the token limit cut a constrained answer before it matched (it is not the answer)."""
    if result["finish_reason"] == "unfinished":
        notice(
            f"warning: the token limit ({result['generated_tokens']}) cut the answer before it matched the "
            "constraint: it is incomplete (raise -n)"
        )


def stream(pieces: Iterable[str], reading=None) -> None:
    """Print text pieces as they come: through rich on a terminal, plain and flushed when piped.
    On a terminal a spinner fills the wait for the first piece (a first compile takes seconds).
    `reading` (`replies.Reading`: a thinking model's, gpt-oss's): the answer on stdout, the reasoning
    dim on stderr, folded on a terminal (`_answer`)."""
    folding = bool(reading) and err.is_terminal
    pieces = _answer(pieces, reading, folding) if reading else iter(pieces)
    if out.is_terminal and err.is_terminal and not folding:  # folding shows its own spinner
        with err.status("compiling and prefilling…", spinner="dots"):
            first = next(pieces, None)
        pieces = itertools.chain([] if first is None else [first], pieces)
    for piece in pieces:
        if out.is_terminal:
            out.print(piece, end="", markup=False)
        else:
            sys.stdout.write(piece)
            sys.stdout.flush()


def _answer(pieces: Iterable[str], reading, folding: bool) -> Iterator[str]:
    """A reply's content pieces as they come (`Reading.visible`); its reasoning on stderr. `folding`
    (a terminal): the reasoning's last lines shown dim while it comes, then folded to one line
    ("thought for 3.2 s, 120 words") when the answer starts, as chat front ends fold it."""
    from rich.live import Live
    from rich.spinner import Spinner
    from rich.text import Text

    text, said, shown, started = "", 0, 0, time.perf_counter()
    live = Live(Spinner("dots", "compiling and prefilling…"), console=err, transient=True) if folding else None

    def fold(reasoning: str) -> None:
        live.stop()
        if reasoning:
            took = time.perf_counter() - started
            err.print(f"▸ thought for {took:.1f} s, {len(reasoning.split())} words", style="dim", markup=False)

    if live:
        live.start()
    try:
        for piece in pieces:
            text += piece
            reasoning, content = reading.visible(text)
            grew = len(reasoning) > said
            if live and live.is_started:
                if content:
                    fold(reasoning)
                elif grew:
                    if not said:
                        started = time.perf_counter()  # the thinking's own time, not the compile's
                    live.update(Text("\n".join(reasoning.splitlines()[-FOLDED_LINES:]), style="dim"))
            elif not live and grew:
                err.print(reasoning[said:], style="dim", end="", markup=False)
            said = len(reasoning)
            if not live and said and not shown and content:
                err.print()  # the reasoning ends its line before the answer
            yield content[shown:]
            shown = len(content)
    finally:
        if live and live.is_started:  # a reply that ended (or was stopped) while thinking
            fold(reading.visible(text)[0])


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


def ask(prompt: str) -> str:
    """One line from the user, with line editing and history where readline exists."""
    try:
        import readline  # noqa: F401  (input() uses it once imported)
    except ImportError:
        pass
    return input(prompt)


def _prefilled(result: dict) -> str:
    t = result["timings"]
    cached = f" (+{t['cached_tokens']} cached)" if t["cached_tokens"] else ""
    return f"{t['prefilled_tokens']} tokens{cached}"


def turn_stats(result: dict, context_used: int, context_size: int) -> None:
    """The one-line footer of a chat turn, on stderr."""
    t = result["timings"]
    compiled = f" · compile {t['compile_s']:.2f} s" if t["compile_cache"] != "none" else ""
    err.print(
        f"prefill {_prefilled(result)}, TTFT {t['ttft_s'] * 1000:.0f} ms · decode {result['generated_tokens']} tokens, "
        f"{t['decode_tok_s']:.1f} tok/s · context {context_used}/{context_size}{compiled}"
        + (" · interrupted" if result["finish_reason"] == "interrupted" else ""),
        style="dim",
        markup=False,
    )


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def _roof(phase: dict, headline: str) -> str:
    """Where a phase sits: its achieved rate against the roof that bounds it."""
    achieved = (
        f"{_si(phase['flop_s'], 'FLOP/s')}, MFU {phase['mfu']:.1%}"
        if headline == "mfu"
        else f"{_si(phase['bytes_s'], 'B/s')}, MBU {phase['mbu']:.1%}"
    )
    above = (
        "; above 100%: data in cache, or roofs probed under load: jaxinfer info --measure"
        if phase[headline] > 1
        else ""
    )
    return f" · {achieved} ({phase['bound']}-bound, {phase['intensity']:.1f} FLOP/B{above})"


def stats(result: dict) -> None:
    """The per-phase figures of one generation, on stderr."""
    t = result["timings"]
    itl = t["itl_ms"]
    roof = t.get("roofline")
    cache = {"hit": "cache hit", "miss": "compiled", "none": "already compiled"}[t["compile_cache"]]
    lines = [
        f"prefill: {_prefilled(result)}, TTFT {t['ttft_s'] * 1000:.1f} ms, {t['prefill_tok_s']:.1f} tok/s"
        + (_roof(roof["prefill"], "mfu") if roof else ""),
        f"decode:  {result['generated_tokens']} tokens, {t['decode_tok_s']:.1f} tok/s, "
        f"ITL mean {itl['mean']:.2f} / p50 {itl['p50']:.2f} / p90 {itl['p90']:.2f} ms"
        + (_roof(roof["decode"], "mbu") if roof else ""),
        f"compile: {t['compile_s']:.2f} s ({cache}); finish: {result['finish_reason']}; seed: {result['seed']}"
        + (f"; matrices on {t['kernels']}" if "kernels" in t else ""),
    ]
    if spec := t.get("speculation"):
        lines.insert(
            2,
            f"speculation: {spec['accepted']} of {spec['drafted']} drafted tokens accepted "
            f"({spec['acceptance_rate']:.0%}), "
            f"{spec['tokens_per_step']:.2f} tokens per decode step",
        )
    if roof:
        lines.append(
            f"roofs:   {_si(roof['peak_flops'], 'FLOP/s')}, {_si(roof['peak_bandwidth'], 'B/s')} ({roof['method']})"
        )
    err.print("\n".join(lines), style="dim", markup=False)


def logprobs(entries: list[dict], prompt: list[dict] | None = None) -> None:
    """Each generated token's log-probability and the alternatives asked for, on stderr; with
    `prompt` (`--echo`), the prompt's tokens first, numbered from their position in it."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="dim", pad_edge=False)
    for column in ("#", "token", "logprob", "p", "alternatives"):
        table.add_column(column, justify="right" if column in ("#", "logprob", "p") else "left")
    numbered = [(f"p{i}", e) for i, e in enumerate(prompt or [])] + [(str(i), e) for i, e in enumerate(entries)]
    for number, e in numbered:
        alternatives = "  ".join(f"{a['token']!r} {math.exp(a['logprob']):.0%}" for a in e["top_logprobs"])
        chosen = e["logprob"]
        said = ("", "") if chosen is None else (f"{chosen:.3f}", f"{math.exp(chosen):.1%}")
        table.add_row(*map(Text, (number, repr(e["token"]), *said, alternatives)))  # Text: "[b]" is not markup
    err.print(table)


def models(records: list[dict]) -> None:
    """`jaxinfer list`: a table on stdout, a model a row, then why each that does not run does not."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="dim", pad_edge=False)
    for column in ("name", "source", "size", "architecture", "runs"):
        table.add_column(column, justify="right" if column == "size" else "left", overflow="fold")
    named = [(r["name"] + (f" --gguf-file {r['gguf_file']}" if "gguf_file" in r else ""), r) for r in records]
    for name, r in named:
        runs = "embeds" if r.get("embeds") else "yes" if r["runs"] else "no"
        table.add_row(*map(Text, (name, r["source"], _bytes(r["size"]), r["architecture"] or "?", runs)))
    out.print(table)
    for name, r in named:
        if not r["runs"]:
            out.print(Text(f"{name}: {r['refused']}"), style="dim")


def _bytes(n: float) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def perplexity(result: dict) -> None:
    line = (
        f"perplexity {result['perplexity']:.4f} (nll {result['nll']:.4f}/token) over {result['tokens']} tokens, "
        f"{result['windows']} windows of {result['context']}"
    )
    if "kl_divergence" in result:
        kl, agreement = result["kl_divergence"], result["top1_agreement"]
        line += f"; vs unquantized: KL {kl:.5f}/token, top-1 agreement {100 * agreement:.2f}%"
    out.print(line)


def _text_of(facts: dict) -> str:
    """How `info` names a multimodal checkpoint whose text model it runs."""
    return f", the text model of a {tower}" if (tower := facts.get("text_model_of")) else ""


def model_info(facts: dict) -> None:
    """`jaxinfer info`: a two-column table on stdout."""
    from rich.table import Table

    w = facts["weight_bytes"]
    state = f" + {_bytes(facts['state_bytes_per_row'] * facts['batch'])} state" if facts["state_bytes_per_row"] else ""
    rows = [
        ("model", f"{facts['model']} ({facts['architecture']}{_text_of(facts)})"),
        (
            "parameters",
            f"{facts['parameters']:,}"
            + (f" ({active:,} active a token)" if (active := facts["active_parameters"]) < facts["parameters"] else ""),
        ),
        (
            "weights",
            f"{_bytes(w['float32'])} float32 · {_bytes(w['bfloat16'])} bfloat16 · {_bytes(w['int8'])} int8 · "
            f"{_bytes(w['int4'])} int4",
        ),
        (
            "running",
            facts["dtype"]
            + (f", matrices {facts['quantize']} ({_bytes(facts['stored_weight_bytes'])})" if facts["quantize"] else ""),
        ),
        (
            "KV cache per token",
            _bytes(facts["kv_bytes_per_token"]) + (f" ({facts['kv_dtype']})" if facts["kv_dtype"] else ""),
        ),
        *(
            [
                (
                    "recurrent state per row",
                    f"{_bytes(facts['state_bytes_per_row'])} (DeltaNet layers, three copies; no growth)",
                )
            ]
            if facts["state_bytes_per_row"]
            else []
        ),
        (
            f"memory at context {facts['context']:,} × batch {facts['batch']}",
            f"{_bytes(facts['total_bytes'])} (weights + {_bytes(facts['kv_cache_bytes'])} KV cache{state})",
        ),
        *(
            [
                (
                    f"per device, over {facts['devices']}",
                    f"{_bytes(facts['weight_bytes_per_device'])} weights, "
                    f"{_bytes(facts['kv_bytes_per_token_per_device'])} KV per token",
                )
            ]
            if facts["devices"] > 1
            else []
        ),
        ("device memory available", _bytes(facts["device_memory_bytes"])),
        (
            "longest context that fits",
            f"{facts['longest_context_that_fits']:,} tokens (the model was trained for "
            f"{facts['max_position_embeddings']:,})",
        ),
        ("peaks", f"{_si(facts['peak_flops'], 'FLOP/s')}, {_si(facts['peak_bandwidth'], 'B/s')} ({facts['method']})"),
        (f"predicted TTFT, {facts['prompt_tokens']:,}-token prompt", f"{facts['predicted_ttft_s'] * 1000:.1f} ms"),
        (
            f"predicted ITL at context {facts['context']:,}",
            f"{facts['predicted_itl_s'] * 1000:.2f} ms ({facts['batch'] / facts['predicted_itl_s']:.0f} tok/s)",
        ),
    ]
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


def bench_table(rows: list[dict], caption: str) -> None:
    """`jaxinfer bench`: one row per (prompt, batch) point, on stdout; ranges on a second line, so
    it fits 80 columns, and cells fold rather than being cut."""
    from rich import box
    from rich.table import Table

    def ms(x: float) -> str:
        return f"{x:.1f}" if x < 100 else f"{x:.0f}"

    table = Table(
        caption=caption,
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 0, 0, 1),
        pad_edge=False,
    )
    meshes = any(r["devices"] > 1 for r in rows)  # each batch over its devices, on a second line
    for name in (
        "prompt",
        "batch\ndevices" if meshes else "batch",
        "TTFT ms\n(min–max)",
        "prefill\ntok/s",
        "MFU",
        "decode\ntok/s\n(min–max)",
        "ITL ms\np50/p99",
        "MBU",
        "compile\ns",
    ):
        table.add_column(name, justify="right", overflow="fold")
    for r in rows:
        ttft, dec = {k: v * 1000 for k, v in r["ttft_s"].items()}, r["decode_tok_s"]
        table.add_row(
            str(r["prompt_tokens"]),
            f"{r['batch']}\n{r['devices']}" if meshes else str(r["batch"]),
            f"{ms(ttft['median'])}\n({ms(ttft['min'])}–{ms(ttft['max'])})",
            f"{r['prefill_tok_s']:.0f}",
            f"{r['prefill']['mfu']:.1%}",
            f"{ms(dec['median'])}\n({ms(dec['min'])}–{ms(dec['max'])})",
            f"{r['itl_ms']['p50']:.2f}\n{r['itl_ms']['p99']:.2f}",
            f"{r['decode']['mbu']:.1%}",
            f"{r['compile_s']:.2f}",
        )
    routed = [r for r in rows if "experts_a_step" in r]
    if routed:  # MBU counts the experts a step read, not all of them
        read = [(r["prompt_tokens"], r["batch"], r["experts_a_step"]) for r in routed]
        table.caption += f"\nexperts a decode step read, a layer (of {read[0][2]['of']}; even routing's): " + "; ".join(
            f"{p}×{b}: {e['counted']:.1f} ({e['even']:.1f})" for p, b, e in read
        )
    speculated = [r for r in rows if "speculation" in r]
    if speculated:
        table.caption += "\nspeculation, drafts kept and tokens per decode step: " + "; ".join(
            f"{r['prompt_tokens']}×{r['batch']}: {r['speculation']['acceptance_rate']:.0%}, "
            f"{r['speculation']['tokens_per_step']:.2f}"
            for r in speculated
        )
    out.print(table)


@contextmanager
def job_progress(total: int, log_every_s: float = 10.0) -> Iterator:
    """Progress of a batch job, on stderr; yields update(done, tokens_per_s). On a terminal a bar
    with an ETA; otherwise a plain line now and then, for logs."""
    if err.is_terminal:
        columns = (
            TextColumn("batch"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task("batch", total=total, rate="")
            yield lambda done, rate: bar.update(task, completed=done, rate=f"{rate:.1f} tok/s")
        return
    last = [0.0]

    def log(done: int, rate: float) -> None:
        now = time.monotonic()
        if now - last[0] >= log_every_s or done == total:
            last[0] = now
            err.print(f"batch: {done}/{total} done, {rate:.1f} tok/s", markup=False)  # quiet in a follower process

    yield log
