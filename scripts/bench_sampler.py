"""The sampler alone, jitted: ms per call for a batch of logits, by the path a row takes.

    python scripts/bench_sampler.py [--rows 16] [--vocab 49152]

"candidates": llama.cpp's defaults (top-k 40, top-p 0.95, min-p 0.05), cut inside the top 256;
"whole vocabulary": T 1 and nothing else; "bisection": a flat row at top-p 0.95, whose nucleus lies
past the candidates. Median of 20 calls after one warm-up; compile time of the first program apart
(the others share it: the settings are traced).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling import SamplerArrays, Sampling, sample

CASES = {
    "candidates": (3.0, Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)),
    "whole vocabulary": (3.0, Sampling(temperature=1.0)),
    "bisection": (0.3, Sampling(temperature=1.0, top_p=0.95)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    normal = np.random.default_rng(0).normal(size=(args.rows, args.vocab))
    seen = jnp.zeros((args.rows, args.vocab), bool)
    keys = jax.random.split(jax.random.key(0), args.rows)
    run = jax.jit(sample)
    for name, (spread, settings) in CASES.items():
        logits = jnp.asarray(normal * spread, jnp.float32)
        arrays = SamplerArrays.from_settings([settings] * args.rows)
        start = time.perf_counter()
        compiled = run.lower(logits, seen, keys, arrays).compile()
        compile_s = time.perf_counter() - start
        compiled(logits, seen, keys, arrays).block_until_ready()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            compiled(logits, seen, keys, arrays).block_until_ready()
            times.append(time.perf_counter() - start)
        print(
            f"{name:17} {args.rows}×{args.vocab}: {1000 * statistics.median(times):6.2f} ms (compile {compile_s:.2f} s)"
        )


if __name__ == "__main__":
    main()
