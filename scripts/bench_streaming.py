"""What live streaming costs per token: chunked decode (what `jaxinfer run` does) against one
whole-request while_loop, same engine, same process, alternated over repeats.

    python scripts/bench_streaming.py --shape smollm-135m --tokens 128 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics

from shapes import SHAPES, loaded

from jaxinfer.engine import Engine
from jaxinfer.sampling import Sampling


def per_token_ms(engine: Engine, prompt: list[int], tokens: int, stream: bool) -> tuple[float, int]:
    run = engine.generate(prompt, Sampling(), tokens, seed=0, stream=stream)
    chunks = sum(1 for _ in run) - 1  # the first "chunk" is prefill's token
    return 1000 * run.timings.decode_s / (run.timings.generated_tokens - 1), chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    cfg = SHAPES[args.shape]
    engine = Engine(cfg, loaded(cfg), args.context, eos_ids=())
    prompt = list(range(1, 65))
    for stream in (True, False):  # compile both paths before timing
        per_token_ms(engine, prompt, 4, stream)
    results = {True: [], False: []}
    chunks = 0
    for _ in range(args.repeat):
        for stream in (True, False):
            ms, n = per_token_ms(engine, prompt, args.tokens, stream)
            results[stream].append(ms)
            chunks = n if stream else chunks
    streamed, whole = statistics.median(results[True]), statistics.median(results[False])
    print(f"shape {args.shape}, {args.tokens} tokens, context {args.context}, median of {args.repeat}")
    print(f"  one while_loop:        {whole:.3f} ms/token")
    print(f"  streamed ({chunks} chunks): {streamed:.3f} ms/token")
    print(f"  streaming cost:        {streamed - whole:+.3f} ms/token ({100 * (streamed / whole - 1):+.1f}%)")


if __name__ == "__main__":
    main()
