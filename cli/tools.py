"""The commands that find, measure or convert a model: `list` (the models on this machine), `info`
(sizes and the roofline's predictions), `bench` (a measured sweep), `perplexity` (what a
quantization costs) and `convert`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from jaxinfer.cli import options, render


def convert(
    source: Path = typer.Argument(..., help="Hugging Face model directory, hub id (org/name) or GGUF file."),
    destination: Path = typer.Argument(..., help="New directory for the converted model."),
    gguf_file: Optional[str] = options.GGUF_FILE,
    dtype: str = typer.Option(
        "auto", "--dtype", help="Stored dtype: auto (the checkpoint's), float32, bfloat16, float16."
    ),
    quantize: Optional[str] = typer.Option(
        None,
        "--quantize",
        "-q",
        metavar="int8|int4",
        show_default=False,
        help="Store the weight matrices quantized (as run --quantize does at load); running the result needs no flag.",
    ),
) -> None:
    """Convert a Hugging Face checkpoint to an orbax checkpoint (with its config and tokenizer)."""
    import time

    from jaxinfer.convert import convert as convert_model

    start = time.perf_counter()
    with render.progress("converting") as progress:
        out = convert_model(source, destination, dtype, progress, quantize, gguf_file)
    render.notice(f"converted {source} → {out} in {time.perf_counter() - start:.1f} s")


def perplexity(
    file: Path = typer.Argument(..., help="Text file to score ('-': stdin)."),
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    max_context: int = typer.Option(
        512, "--max-context", "--ctx-size", "-c", help="Tokens per window (llama-perplexity's -c)."
    ),
    stride: Optional[int] = typer.Option(
        None,
        "--stride",
        help="Tokens a window advances; each scores only tokens the previous did not [default: half the window].",
    ),
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
    kv_dtype: Optional[str] = options.KV_DTYPE,
    kl: bool = typer.Option(
        False,
        "--kl",
        help="Also run the model at full precision (float32, unquantized weights and KV cache): KL divergence from it "
        "and top-1 agreement, per token.",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of a line."),
) -> None:
    """Perplexity of a text under the model, over sliding windows: how to judge a quantization."""
    from jaxinfer.errors import JaxinferError
    from jaxinfer.perplexity import perplexity as measure

    options.check_positive(max_context=max_context, stride=stride)
    text = options.read_prompt(None, None, file, escape=False)
    if kl and not (quantize or kv_dtype or dtype in ("bfloat16", "float16")):
        raise JaxinferError(
            "--kl compares against the model at full precision: give --quantize, --kv-dtype or a 16-bit --dtype too"
        )
    loaded = options.open_model(model, dtype=dtype, quantize=quantize, kv_dtype=kv_dtype, gguf_file=gguf_file).model
    plain = options.open_model(model, dtype="float32", gguf_file=gguf_file).model if kl else None
    reference = (plain.config, plain.params) if kl else None
    ids = loaded.tokenizer.encode(text)
    with render.progress("scoring") as progress:
        result = measure(loaded.config, loaded.params, ids, max_context, stride, reference, progress)
    result = {
        "model": str(loaded.path),
        "dtype": loaded.dtype,
        "quantize": loaded.quantize,
        "kv_dtype": loaded.config.kv_dtype,
        **result,
    }
    if json_output:
        render.print_json(json.dumps(result))
    else:
        render.perplexity(result)


def list_models(
    models_dir: Optional[list[Path]] = typer.Option(
        None, "--models-dir", help="Also the models in DIR (its subdirectories with a config.json, its GGUF files)."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON list instead of a table."),
) -> None:
    """The models on this machine (bundled, the hub cache's, ollama's, a directory's), and whether each runs."""
    from jaxinfer.listing import find

    records = [found.record() for found in find(models_dir or [])]
    if json_output:
        render.print_json(json.dumps(records))
    else:
        render.models(records)


def info(
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    max_context: Optional[int] = options.MAX_CONTEXT,
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Sequences decoded together."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", "-p", help="Prompt length for the predicted TTFT."),
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
    kv_dtype: Optional[str] = options.KV_DTYPE,
    devices: Optional[int] = options.DEVICES,
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    peak_flops: Optional[float] = options.PEAK_FLOPS,
    peak_bandwidth: Optional[float] = options.PEAK_BANDWIDTH,
    measure: bool = typer.Option(
        False, "--measure", help="Probe the machine's roofs again (on an idle machine); each roof keeps its best probe."
    ),
) -> None:
    """Sizes, memory and the roofline's TTFT and ITL for a model on this machine (weights not loaded)."""
    from dataclasses import replace

    from jaxinfer.ceilings import check_peaks, device_memory_bytes
    from jaxinfer.forms import layout_for_batch, methods_named
    from jaxinfer.kvcache import check_kv_dtype
    from jaxinfer.loading import compute_dtype, resolve_dtype, roof_dtype, stored_quantization
    from jaxinfer.modeldir import METHODS_KEY, load_config
    from jaxinfer.roofline import Storage, model_facts
    from jaxinfer.runtime import check_backend

    options.check_positive(max_context=max_context, batch_size=batch_size, prompt_tokens=prompt_tokens)
    check_peaks(peak_flops, peak_bandwidth)
    mesh = options.mesh(devices)
    model_dir, cfg, config_json = load_config(model, gguf_file)
    layout = layout_for_batch(batch_size, mesh is not None)
    chosen = resolve_dtype(dtype, config_json, layout)
    quantize = stored_quantization(config_json, quantize)
    cfg = replace(cfg, kv_dtype=check_kv_dtype(kv_dtype))
    context = options.context(cfg.max_position_embeddings, max_context)
    roofs = options.ceilings(roof_dtype(chosen, layout), peak_flops, peak_bandwidth, remeasure=measure)
    methods = config_json.get(METHODS_KEY)  # a GGUF file's, or a converted model's: each matrix's own
    storage = Storage.of(chosen, quantize, compute_dtype(chosen, layout), cfg, methods)
    if methods:  # as `run --stats` names them
        quantize = methods_named(methods)
    shared = check_backend() == "cpu"  # the CPU's devices share its memory
    facts = model_facts(
        cfg, storage, context, batch_size, prompt_tokens, roofs, device_memory_bytes(), mesh.size if mesh else 1, shared
    )
    facts = {
        "model": str(model_dir),
        "architecture": cfg.architecture,
        **({"text_model_of": cfg.multimodal} if cfg.multimodal else {}),
        "dtype": chosen,
        "quantize": quantize,
        "kv_dtype": cfg.kv_dtype,
        **facts,
    }
    if json_output:
        render.print_json(json.dumps(facts))
    else:
        render.model_info(facts)


def _int_list(text: str, flag: str) -> list[int]:
    from jaxinfer.errors import JaxinferError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise JaxinferError(f"{flag} takes positive whole numbers separated by commas, not {text!r}")
    return values


def bench(
    model: Optional[Path] = options.MODEL,
    gguf_file: Optional[str] = options.GGUF_FILE,
    prompts: str = typer.Option(
        "128,512,2048", "--prompt-tokens", "-p", help="Prompt lengths to sweep, comma-separated."
    ),
    new_tokens: int = typer.Option(
        128, "--max-tokens", "--n-predict", "-n", help="Tokens generated per row at each point."
    ),
    batches: str = typer.Option("1,8", "--batch-size", "-b", help="Batch sizes to sweep, comma-separated."),
    repeat: int = typer.Option(5, "--repeat", "-r", help="Timed runs per point (after one warm-up)."),
    max_context: Optional[int] = typer.Option(
        None,
        "--max-context",
        "-c",
        help="Cache positions allocated [default: each point's prompt + new tokens]; decode reads only the kv buckets "
        "its rows reach.",
    ),
    prefill_chunk: Optional[int] = options.PREFILL_CHUNK,
    speculate: Optional[str] = options.SPECULATE,
    num_draft: Optional[int] = options.NUM_DRAFT,
    draft_model: Optional[Path] = options.DRAFT_MODEL,
    dtype: str = options.DTYPE,
    quantize: Optional[str] = options.QUANTIZE,
    kv_dtype: Optional[str] = options.KV_DTYPE,
    devices: Optional[str] = typer.Option(
        None,
        "--devices",
        metavar="N,...",
        show_default=False,
        help="Device counts to sweep, comma-separated: the model spread over each in turn, as run --devices N does "
        "[default: 1 on the CPU, every local GPU/TPU otherwise].",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
    plot_file: Optional[Path] = typer.Option(
        None, "--plot", metavar="FILE.png", help="Also draw TTFT and decode speed beside their roofline."
    ),
    peak_flops: Optional[float] = options.PEAK_FLOPS,
    peak_bandwidth: Optional[float] = options.PEAK_BANDWIDTH,
) -> None:
    """Measure prefill (TTFT, MFU) and decode (tokens/s, ITL, MBU) over prompt lengths and batch sizes."""
    from jaxinfer import bench as benchmark
    from jaxinfer.ceilings import check_peaks

    prompt_list, batch_list = _int_list(prompts, "--prompt-tokens"), _int_list(batches, "--batch-size")
    device_list = _int_list(devices, "--devices") if devices else [None]
    options.check_positive(max_tokens=new_tokens, repeat=repeat, max_context=max_context)
    check_peaks(peak_flops, peak_bandwidth)
    # on the CPU: all the devices any count needs, before JAX starts
    options.mesh(max(device_list, key=lambda n: n or 0))
    rows = []
    for count in device_list:  # loaded again for each: onto its devices, in its layout, as run would
        mesh = options.mesh(count)
        opened = options.open_model(model, mesh=mesh, **options.model_flags(locals()))
        loaded = opened.model
        roofs = options.ceilings(loaded.roofed_in, peak_flops, peak_bandwidth)
        with render.progress(f"benchmarking{f' on {mesh.size} devices' if mesh else ''}") as progress:
            rows += benchmark.sweep(
                loaded.config,
                loaded.params,
                prompt_list,
                batch_list,
                max(2, new_tokens),
                repeat,
                roofs,
                progress,
                max_context,
                opened.decoding,
            )
    if plot_file:
        benchmark.plot(rows, plot_file, f"{loaded.path.name}, {loaded.storage}")
    if json_output:
        render.print_json(
            json.dumps(
                {
                    "model": str(loaded.path),
                    "dtype": loaded.dtype,
                    "quantize": loaded.quantize,
                    "kv_dtype": loaded.config.kv_dtype,
                    "kernels": loaded.kernels,
                    "peak_flops": roofs.peak_flops,
                    "peak_bandwidth": roofs.peak_bandwidth,
                    "method": roofs.method,
                    "points": rows,
                }
            )
        )
    else:
        render.bench_table(
            rows, f"{loaded.path.name}, {loaded.storage}, matrices on {loaded.kernels}; peaks {roofs.method}"
        )
