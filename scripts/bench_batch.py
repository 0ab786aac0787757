"""Batch throughput: generated tokens/s against the batch size, and continuous against static batching.

    python scripts/bench_batch.py --model bundled --sizes 1,4,16,32
    python scripts/bench_batch.py --model tinyllama-1.1b --sizes 1,4,16,32 --requests 32
    python scripts/bench_batch.py --model tinyllama-1.1b --sizes 4,16,32 --requests 32 --dtype bfloat16

A fixed request set (seeded random prompts of 32–96 tokens, 64 new tokens each, EOS off so every request
costs the same) runs through `Scheduler` at each batch size, after a warm-up of the same requests cut
to 2 tokens (compile time of programs first needed later is subtracted). Then requests of mixed output
lengths (8 to 256 new tokens, long-tailed) run at one batch size with continuous and with static
batching. Run from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, loaded  # noqa: E402

from jaxinfer.forms import layout_for_batch  # noqa: E402
from jaxinfer.loading import LoadedModel, load_model  # noqa: E402
from jaxinfer.sampling import Sampling  # noqa: E402
from jaxinfer.scheduler import Request, Scheduler  # noqa: E402


def models_for(name: str, dtype: str, sizes) -> dict[int, LoadedModel]:
    """Batch size → the model as `jaxinfer batch` loads it for that size (one load per layout)."""
    by_layout = {}
    for layout in {layout_for_batch(size) for size in sizes}:
        if name == "bundled":
            by_layout[layout] = dataclasses.replace(load_model(dtype=dtype, layout=layout), eos_ids=())
        else:
            cfg = SHAPES[name]
            by_layout[layout] = LoadedModel(
                Path(name),
                cfg,
                loaded(cfg, dtype=jnp.dtype(dtype), layout=layout),
                tokenizer=None,
                dtype=dtype,
                quantize=None,
                sampling=Sampling(),
                eos_ids=(),
                max_new_tokens=None,
            )
    return {size: by_layout[layout_for_batch(size)] for size in sizes}


def request_set(model: LoadedModel, count: int, new_tokens, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    return [
        Request(i, rng.integers(3, vocab, rng.integers(32, 97)).tolist(), Sampling(), int(new_tokens(rng)), seed=i)
        for i in range(count)
    ]


def tokens_per_s(
    model: LoadedModel, batch_size: int, requests: list[Request], context: int, continuous: bool = True
) -> tuple[float, float]:
    runner = Scheduler(model, batch_size, context)
    warm_up = [dataclasses.replace(r, max_tokens=2) for r in requests]  # compiles most programs used
    runner.run(warm_up, lambda r: None)
    done, compiling = runner.stats.generated_tokens, runner.stats.compile.seconds
    start = time.perf_counter()
    runner.run(requests, lambda r: None, continuous)
    # a program first needed in the timed run (a kv bucket, an admission group size) compiles there: not counted
    seconds = time.perf_counter() - start - (runner.stats.compile.seconds - compiling)
    return (runner.stats.generated_tokens - done) / seconds, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bundled", *sorted(SHAPES)], default="bundled")
    parser.add_argument("--sizes", default="1,4,16,32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--mixed-batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32, or bfloat16 (stored bfloat16, computed in float32 on the CPU kernel)",
    )
    args = parser.parse_args()

    sizes = [int(s) for s in args.sizes.split(",")]
    models = models_for(args.model, args.dtype, {*sizes, args.mixed_batch})
    model = models[sizes[0]]
    fixed = request_set(model, args.requests, lambda rng: 64)
    print(f"{args.model}: {args.requests} requests, 32–96 prompt tokens, 64 new tokens each, {args.dtype}")
    base = None
    for size in sizes:
        rate, seconds = tokens_per_s(models[size], size, fixed, args.context)
        base = base or rate
        print(f"  B={size:>3}: {rate:8.1f} generated tok/s ({seconds:.1f} s, ×{rate / base:.1f} vs B=1)", flush=True)

    mixed = request_set(model, args.requests, lambda rng: min(256, 8 + int(rng.pareto(1.2) * 24)), seed=1)
    lengths = [r.max_tokens for r in mixed]
    print(
        f"mixed lengths at B={args.mixed_batch}: {sum(lengths)} tokens, {min(lengths)}–{max(lengths)} per request "
        f"(median {int(np.median(lengths))})"
    )
    rates = {}
    for continuous in (True, False):
        rates[continuous], seconds = tokens_per_s(
            models[args.mixed_batch], args.mixed_batch, mixed, args.context, continuous
        )
        print(
            f"  {'continuous' if continuous else 'static':>10}: {rates[continuous]:8.1f} tok/s ({seconds:.1f} s)",
            flush=True,
        )
    print(f"  continuous / static: ×{rates[True] / rates[False]:.2f}")


if __name__ == "__main__":
    main()
