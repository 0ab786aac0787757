"""Attention on the CPU kernel against XLA's, in the same sitting: TTFT and decode speed by prompt length.

    python scripts/bench_attention.py --model smollm-135m --prompts 100,1000,3000 --context 4096

For each prompt length, `jaxinfer run`'s engine (batch 1, `--prefill-chunk 128`) prefills a random
prompt and decodes `--new` tokens in one loop, with every matrix on the kernels as run loads them,
once with attention on XLA's einsums (as on a CPU without AVX-512, a GPU or a mesh) and once on
the attention kernel. Each figure is the best of two warm runs (compile excluded). Run from the
repository root.

    python scripts/bench_attention.py --cold 16,1000   # the kernel alone: batch 16, 1000 keys

`--cold B,KEYS` times the kernel alone, as a decode step calls it: B rows of one query each over a
SmolLM-135M-shaped cache of 30 layers (3 kv heads of 64, 3 query heads each), float32, every layer
in turn inside one jitted loop, so each call finds its layer's keys and values cold in memory: ms a
layer and the GB/s of K and V read, best of 5.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch import models_for  # noqa: E402
from shapes import SHAPES  # noqa: E402

from jaxinfer import kernel  # noqa: E402
from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.sampling import Sampling  # noqa: E402
from jaxinfer.slots import Decoding  # noqa: E402


def measure(model, prompt: list[int], new: int, context: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s), best of two runs after one that compiles."""
    engine = Engine(model.config, model.params, context, (), Decoding(128))
    runs = []
    for first in (1, 2, 3):  # a different first token each time: nothing reused from the cache
        stream = engine.generate([first] + prompt[1:], Sampling(), new, ignore_eos=True, stream=False)
        list(stream)
        runs.append((stream.timings.ttft_s, stream.timings.decode_tok_s))
    return min(r[0] for r in runs[1:]), max(r[1] for r in runs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bundled", *sorted(SHAPES)], default="smollm-135m")
    parser.add_argument("--prompts", default="100,1000,3000")
    parser.add_argument("--new", type=int, default=65)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--cold", help="B,KEYS: the kernel alone over a cold 30-layer cache")
    args = parser.parse_args()
    if args.cold:
        return cold(*(int(v) for v in args.cold.split(",")))
    if not kernel.vectorised():
        sys.exit("the attention kernel does not run on this CPU (it needs the kernels built and AVX-512)")

    model = models_for(args.model, "float32", (1,))[1]
    rng = np.random.default_rng(0)
    print(
        f"{args.model}, float32, batch 1 at -c {args.context}: TTFT and decode ({args.new} tokens), attention on XLA | "
        "on the kernel"
    )
    print(
        f"{'prompt':>6} {'TTFT XLA s':>11} {'kernel s':>9} {'ratio':>6} {'decode XLA tok/s':>17} {'kernel tok/s':>13} "
        f"{'ratio':>6}"
    )
    heads = kernel.ATTENTION_HEAD_DIMS
    for n in (int(p) for p in args.prompts.split(",")):
        prompt = rng.integers(3, model.config.vocab_size, n).tolist()
        kernel.ATTENTION_HEAD_DIMS = ()  # no head size is the kernel's: caches are made for XLA's attention
        xla = measure(model, prompt, args.new, args.context)
        kernel.ATTENTION_HEAD_DIMS = heads
        ours = measure(model, prompt, args.new, args.context)
        print(
            f"{n:>6} {xla[0]:>11.3f} {ours[0]:>9.3f} {xla[0] / ours[0]:>5.2f}x {xla[1]:>17.1f} {ours[1]:>13.1f} "
            f"{ours[1] / xla[1]:>5.2f}x",
            flush=True,
        )


def cold(batch: int, keys: int, layers: int = 30, loops: int = 20) -> None:
    """ms a layer of the attention kernel for `batch` decode rows over `keys` keys, every layer cold."""
    import jax
    import jax.numpy as jnp

    if not kernel.available():
        sys.exit("the kernels were not built for this machine (or the backend is not the CPU)")
    kv, group, hd = 3, 3, 64
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((layers, batch, kv, keys, hd), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, kv, group, hd), np.float32))
    positions = jnp.full((batch, 1), keys - 1, jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)

    @jax.jit
    def run(q, k, v):
        def body(_, out):  # each call's queries are the last one's output: none is skipped
            for layer in range(layers):
                out = kernel.attention(out, positions, k, v, rows, layer, keys, None, hd**-0.5, None)
            return out

        return jax.lax.fori_loop(0, loops, body, q)

    jax.block_until_ready(run(q, k, v))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(run(q, k, v))
        best = min(best, (time.perf_counter() - start) / loops / layers)
    read = 2 * batch * kv * keys * hd * 4
    print(f"{kernel.isa()}: B={batch} over {keys} keys: {best * 1e3:.3f} ms a layer, {read / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
