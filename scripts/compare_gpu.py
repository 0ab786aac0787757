"""jaxinfer against transformers on one GPU, on the same random-weight bfloat16 checkpoints, with the
GPU's roofs, in one run:

    python scripts/compare_gpu.py                      # Llama-3.2-1B and Llama-3.1-8B shapes
    python scripts/compare_gpu.py --shapes llama-3.2-1b --batch 1,16 --quantize int8

Each shape (`scripts/shapes.py`) becomes a bfloat16 checkpoint of that shape made by transformers
(`compare_peers.checkpoint`: on the GPU where there is one, its random initialisation, the bundled
model's tokenizer), kept in `--work`. Each engine runs
in a process of its own (one holds the GPU's memory at a time): transformers eager in bfloat16
(prefill = one forward pass over the prompt; decode = `generate`'s tokens after the first over
their time), jaxinfer as `jaxinfer bench` measures it (prefill = TTFT; decode in calls of
`bench.STEPS_PER_CALL` steps), median of `--repeat` after a warm-up. The roofs are jaxinfer's
(`ceilings`, probed afresh): MFU is prefill's FLOPs over the matmul roof, MBU decode's bytes (every
weight and the cache read once a step) over the bandwidth roof. Prints a Markdown table and writes
it as the section "## On a GPU" of BENCHMARKS.md (`--out`), replacing an earlier one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_peers import checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## On a GPU"


def transformers_rates(model_dir: Path, prompt: int, new: int, batch: int, repeat: int) -> dict:
    import statistics
    import time

    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(100, 3000, (batch, prompt), device=device)
    prefill, decode = [], []
    with torch.no_grad():
        for _ in range(repeat + 1):  # the first warms up
            sync()
            start = time.perf_counter()
            model(ids)
            sync()
            first = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
            )
            sync()
            total = time.perf_counter() - start
            prefill.append(batch * prompt / first)
            decode.append(batch * (new - 1) / (total - first))
    return {
        "prefill_tok_s": statistics.median(prefill[1:]),
        "decode_tok_s": statistics.median(decode[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "version": f"torch {torch.__version__}, transformers {transformers.__version__}",
    }


def jaxinfer_rates(model_dir: Path, prompt: int, new: int, batch: int, repeat: int, quantize: str | None) -> dict:
    import jax

    from jaxinfer.bench import bench_point
    from jaxinfer.ceilings import machine_ceilings
    from jaxinfer.loading import open_model

    opened = open_model(model_dir, dtype="bfloat16", quantize=quantize)
    loaded = opened.model
    roofs = machine_ceilings(loaded.roofed_in, remeasure=True)
    point = bench_point(loaded.config, loaded.params, prompt, batch, new, repeat, roofs, decoding=opened.decoding)
    return {
        "prefill_tok_s": point["prefill_tok_s"],
        "decode_tok_s": point["decode_tok_s"]["median"],
        "mfu": point["prefill"].get("mfu"),
        "mbu": point["decode"].get("mbu"),
        "compile_s": point["compile_s"],
        "roofs": f"{roofs.peak_flops / 1e12:.0f} TFLOP/s, {roofs.peak_bandwidth / 1e12:.2f} TB/s",
        "device": jax.devices()[0].device_kind,
        "version": f"jax {jax.__version__}",
    }


def measure(engine: str, model_dir: Path, args, batch: int, quantize: str | None = None) -> dict:
    """One engine's rates, in a process of its own."""
    command = [sys.executable, __file__, "--one", engine, "--dir", str(model_dir), "--prompt", str(args.prompt)]
    command += ["--tokens", str(args.tokens), "--repeat", str(args.repeat), "--batch", str(batch)]
    command += ["--quantize", quantize] if quantize else []
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    parser.add_argument("--quantize", default="", help="jaxinfer's quantizations to add, comma-separated (int8,int4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/jaxinfer-gpu"))
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--one", choices=("jaxinfer", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one engine, one line of JSON
        batch = int(args.batch)
        if args.one == "transformers":
            rates = transformers_rates(args.dir, args.prompt, args.tokens, batch, args.repeat)
        else:
            rates = jaxinfer_rates(args.dir, args.prompt, args.tokens, batch, args.repeat, args.quantize or None)
        print(json.dumps(rates))
        return

    args.work.mkdir(parents=True, exist_ok=True)
    rows, device, versions = [], "", set()
    for shape in args.shapes.split(","):
        model_dir = checkpoint(shape, args.work, "bfloat16")
        for batch in (int(b) for b in args.batch.split(",")):
            peer = measure("transformers", model_dir, args, batch)
            for quantize in [None] + [q for q in args.quantize.split(",") if q]:
                ours = measure("jaxinfer", model_dir, args, batch, quantize)
                device, roofs = ours["device"], ours["roofs"]
                versions |= {ours["version"], peer["version"]}
                rows.append((shape, batch, quantize or "bfloat16", ours, peer))
                print(json.dumps({"shape": shape, "batch": batch, "weights": quantize, "jaxinfer": ours, "peer": peer}))

    lines = [
        f"{SECTION}: jaxinfer against transformers ({datetime.date.today()}, {device})",
        "",
        f"`python scripts/compare_gpu.py --shapes {args.shapes} --batch {args.batch}"
        f"{f' --quantize {args.quantize}' if args.quantize else ''}`: random-weight bfloat16 checkpoints, "
        f"{args.prompt} prompt tokens, {args.tokens} new tokens (greedy, EOS ignored), median of {args.repeat} after "
        f"a warm-up; transformers eager in bfloat16; roofs probed by jaxinfer: {roofs}; "
        f"{', '.join(sorted(versions))}.",
        "",
        "| shape | batch | jaxinfer weights | prefill tok/s (MFU) | transformers | ÷ | decode tok/s (MBU) | "
        "transformers | ÷ | compile s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, batch, weights, ours, peer in rows:
        lines.append(
            f"| {shape} | {batch} | {weights} | {ours['prefill_tok_s']:,.0f} ({ours['mfu']:.0%}) | "
            f"{peer['prefill_tok_s']:,.0f} | {ours['prefill_tok_s'] / peer['prefill_tok_s']:.2f} | "
            f"{ours['decode_tok_s']:,.1f} ({ours['mbu']:.0%}) | {peer['decode_tok_s']:,.1f} | "
            f"{ours['decode_tok_s'] / peer['decode_tok_s']:.2f} | {ours['compile_s']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    # in place of the last run's section, else after the first (compare_peers.py's CPU table)
    text = args.out.read_text() if args.out.is_file() else ""
    before, found, after = text.partition("\n" + SECTION)
    if not found:
        before, found, after = text.partition("\n## ")
        after = f"## {after}" if found else ""
    else:
        after = after.partition("\n## ")[2]
        after = f"## {after}" if after else ""
    args.out.write_text(before.rstrip("\n") + "\n\n" + table + (f"\n{after}" if after else ""))
    print(table)


if __name__ == "__main__":
    main()
