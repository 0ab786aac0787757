"""Load time of the two on-disk forms of the same weights: Hugging Face safetensors and our orbax
checkpoint, alternated over repeats in one process.

    python scripts/bench_load.py --shape smollm-135m --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file
from shapes import SHAPES, random_params

from jaxinfer.checkpoint import restore_params, save_params
from jaxinfer.weights import abstract_params, read_checkpoint, weight_table


def write_safetensors(cfg, params, path: Path) -> None:
    tensors = {}
    for name, (tree_path, *_) in weight_table(cfg).items():
        node = params
        for key in tree_path:
            node = node[key]
        tensors[name] = np.asarray(node)
    save_file(tensors, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    cfg = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = random_params(cfg)
        write_safetensors(cfg, params, tmp / "model.safetensors")
        save_params(params, tmp / "orbax")
        del params
        loaders = {
            "safetensors": lambda: read_checkpoint(cfg, [tmp / "model.safetensors"], jax.numpy.float32),
            "orbax": lambda: restore_params(tmp / "orbax", abstract_params(cfg, jax.numpy.float32)),
        }
        times = {name: [] for name in loaders}
        for _ in range(args.repeat):
            for name, load in loaders.items():
                start = time.perf_counter()
                jax.block_until_ready(load())
                times[name].append(time.perf_counter() - start)
    gb = sum(np.prod(w.shape) for w in weight_table(cfg).values()) * 4 / 1e9
    print(f"shape {args.shape} ({gb:.2f} GB float32), median of {args.repeat}")
    for name, t in times.items():
        print(f"  {name:12s} {statistics.median(t):6.2f} s  ({gb / statistics.median(t):.2f} GB/s)")


if __name__ == "__main__":
    main()
