"""`jaxinfer embed`: texts in, one JSON line of its embedding each out (`jaxinfer.embeddings`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from jaxinfer.cli import batch, options, render

POOLING = typer.Option(
    None,
    "--pooling",
    metavar="last|mean|cls|max",
    help="How a text's token states become one vector (llama.cpp's --pooling) [default: the model's "
    "sentence-transformers Pooling module, else last].",
)
CHUNK = 256  # texts embedded (and their lines written) at a time: an interrupted job keeps what was written


def embed(
    texts: Optional[list[str]] = typer.Argument(
        None, help="Texts to embed [default: one a line from --file or stdin]."
    ),
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    file: Optional[str] = typer.Option(None, "--file", "-f", help="Texts to embed, one a line ('-': stdin)."),
    jsonl: bool = typer.Option(
        False, "--jsonl", help='The lines are JSON objects, {"input": TEXT} with an optional "id" given back.'
    ),
    pooling: Optional[str] = POOLING,
    prompt_name: Optional[str] = typer.Option(
        None,
        "--prompt-name",
        help="The model's prompt to put before each text (sentence-transformers' prompt_name: Qwen3-Embedding's "
        "query) [default: the model's default prompt, if it has one].",
    ),
    dimensions: Optional[int] = typer.Option(
        None, "--dimensions", help="Keep each vector's first N (a Matryoshka model's smaller one), normalised again."
    ),
    truncate: bool = typer.Option(
        False, "--truncate", help="Embed a text over the model's limit by its first tokens [default: refuse it]."
    ),
    max_context: Optional[int] = options.MAX_CONTEXT,
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
) -> None:
    """Embed texts (an embedding model's, or any model's pooled states): a JSON line each, in order."""
    from jaxinfer import embeddings
    from jaxinfer.errors import JaxinferError

    options.check_positive(dimensions=dimensions)
    if texts and file is not None:
        raise JaxinferError("give the texts as arguments or --file, not both")
    lines = texts or [line for line in _lines(file or "-") if line.strip()]
    if jsonl:
        lines = [_item(line) for line in lines]
    opened = options.open_model(model, generates=False, **options.model_flags(locals()))
    loaded = with_pooling(opened.model, pooling)
    started, tokens, failed, written = time.perf_counter(), 0, 0, 0
    try:
        with render.progress("embedding") as progress:
            for start in range(0, len(lines), CHUNK):
                items = [line if jsonl else {"input": line} for line in lines[start : start + CHUNK]]
                records, ids, skips = [], [], []
                for index, item in enumerate(items, start):
                    record = {"index": index} | ({"id": item["id"]} if isinstance(item, dict) and "id" in item else {})
                    try:
                        if isinstance(item, Exception):
                            raise item
                        asked = embeddings.Asked([item["input"]], dimensions, truncate, prompt_name)
                        (one,), (skip,) = embeddings.tokenized(loaded, asked, opened.context)
                        ids.append(one), skips.append(skip), records.append(record | {"tokens": len(one)})
                    except JaxinferError as e:
                        records.append(record | {"error": str(e)})
                vectors = embeddings.embed(loaded.params, loaded.config, loaded.pooler, ids, skips)
                vectors = iter(embeddings.shortened(vectors, dimensions, loaded.pooler))
                for record in records:
                    if "error" not in record:
                        record["embedding"] = next(vectors).tolist()
                    sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
                sys.stdout.flush()
                written += len(records)
                failed += sum("error" in r for r in records)
                tokens += sum(len(i) for i in ids)
                if progress:
                    progress(written, len(lines))
    except KeyboardInterrupt:
        render.notice(f"embed: interrupted; {written} of {len(lines)} texts written")
        raise typer.Exit(130) from None
    seconds = time.perf_counter() - started
    render.notice(
        f"embed: {written - failed} of {len(lines)} texts, {tokens} tokens in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.0f} tok/s)" + (f"; {failed} could not be embedded" if failed else "")
    )
    if failed:
        raise typer.Exit(min(failed, batch.MAX_EXIT_CODE))


def with_pooling(loaded, pooling: Optional[str]):
    """The model pooling as --pooling says (its own way where not given)."""
    from jaxinfer.embeddings import POOLINGS
    from jaxinfer.errors import JaxinferError

    if pooling is None:
        return loaded
    if pooling not in POOLINGS:
        raise JaxinferError(f"--pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    return replace(loaded, pooler=replace(loaded.pooler, pooling=pooling))


def _lines(path: str) -> list[str]:
    from jaxinfer.errors import JaxinferError

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxinferError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return text.splitlines()


def _item(line: str) -> dict | Exception:
    """A --jsonl line: its object, or what is wrong with it (an error record, the rest go on)."""
    from jaxinfer.errors import JaxinferError

    try:
        item = json.loads(line)
    except ValueError as e:
        return JaxinferError(f"not a JSON line ({e})")
    if not isinstance(item, dict) or not isinstance(item.get("input"), str):
        return JaxinferError('a --jsonl line must be an object with "input": the text to embed')
    return item
