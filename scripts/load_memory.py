"""Peak memory while loading a model: the process's resident set sampled every 5 ms through
`load_model`, over what it held before, against the loaded weights' bytes.

    python scripts/load_memory.py MODEL [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import threading
import time


def resident() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    import jax

    from jaxinfer.loading import load_model

    peak, loading = [0], threading.Event()
    loading.set()

    def watch() -> None:
        while loading.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.005)

    before = resident()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    model = load_model(args.model, dtype=args.dtype, layout="out_in")
    loading.clear()
    watcher.join()
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params))
    print(
        f"weights {size / 2**20:.0f} MiB; peak while loading {(peak[0] - before) / 2**20:.0f} MiB over the start "
        f"= {(peak[0] - before) / size:.2f}x; held after {(resident() - before) / 2**20:.0f} MiB"
    )


if __name__ == "__main__":
    main()
