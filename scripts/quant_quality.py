"""Quality of bfloat16 and of each quantization (weights, KV cache) on the bundled model: perplexity
over held-out Python text (the
stdlib files its training held out), with the KL divergence from float32 and top-1 agreement.

    python scripts/quant_quality.py [--files 8] [-c 512] [--json]

Writes the held-out text to a temporary file and runs `jaxinfer perplexity` on it once per setting,
so the figures are the CLI's own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_default_model import is_validation, stdlib_files  # noqa: E402

SETTINGS = {
    "float32": [],
    "bfloat16": ["--dtype", "bfloat16", "--kl"],
    "int8": ["--quantize", "int8", "--kl"],
    "int4": ["--quantize", "int4", "--kl"],
    "kv int8": ["--kv-dtype", "int8", "--kl"],
    "int8+kv8": ["--quantize", "int8", "--kv-dtype", "int8", "--kl"],
}


def held_out_text(files: int, fraction: float = 0.05) -> str:
    root, paths = stdlib_files()
    held = [p for p in paths if is_validation(p.relative_to(root), fraction)][:files]
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=8, help="held-out files to score")
    parser.add_argument("-c", "--max-context", type=int, default=512)
    parser.add_argument("-m", "--model", help="model directory [default: the bundled one]")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(held_out_text(args.files))
    rows = {}
    for name, flags in SETTINGS.items():
        model = ["-m", args.model] if args.model else []
        proc = subprocess.run(
            ["jaxinfer", "perplexity", f.name, "-c", str(args.max_context), "--json", *model, *flags],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[name] = json.loads(proc.stdout)
    Path(f.name).unlink()
    if args.json:
        print(json.dumps(rows))
        return
    base = rows["float32"]["perplexity"]
    print(f"{rows['float32']['tokens']} tokens, windows of {args.max_context}")
    print(f"{'setting':8} {'perplexity':>10} {'ratio':>7} {'KL/token':>9} {'top-1 agree':>11}")
    for name, r in rows.items():
        kl = f"{r['kl_divergence']:.5f}" if "kl_divergence" in r else "-"
        agree = f"{100 * r['top1_agreement']:.2f}%" if "top1_agreement" in r else "-"
        print(f"{name:8} {r['perplexity']:10.4f} {r['perplexity'] / base:7.4f} {kl:>9} {agree:>11}")


if __name__ == "__main__":
    main()
