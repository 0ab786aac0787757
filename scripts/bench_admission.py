"""A long prompt admitted into a running batch: how much it holds up the running row, per prefill chunk.

    python scripts/bench_admission.py --model smollm-135m --chunks 0,64,128,256,512

A B=2 job at `--context`: request 0 decodes `--running` tokens throughout; request 1 (short) ends
early and request 2, a `--prompt`-token prompt, takes its slot while request 0 runs. For each
`--prefill-chunk` it reports request 0's inter-token latency (p50, max, max/p50: the stall), request
2's TTFT in the job, and the same prompt's TTFT alone (`jaxinfer run`: chunks back to back), each
from a second, warm run (compile excluded). Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch import models_for  # noqa: E402
from shapes import SHAPES  # noqa: E402

from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.sampling import Sampling  # noqa: E402
from jaxinfer.scheduler import Request, Scheduler  # noqa: E402
from jaxinfer.slots import Decoding  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bundled", *sorted(SHAPES)], default="smollm-135m")
    parser.add_argument("--chunks", default="0,64,128,256,512")
    parser.add_argument("--prompt", type=int, default=3000)
    parser.add_argument("--running", type=int, default=400, help="tokens request 0 generates")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()

    models = models_for(args.model, "float32", (1, 2))
    model, batched = models[1], models[2]  # as `jaxinfer run` and `jaxinfer batch -b 2` load them
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    long_prompt = rng.integers(3, vocab, args.prompt).tolist()
    requests = [
        Request(0, rng.integers(3, vocab, 16).tolist(), Sampling(), args.running, seed=0),
        Request(1, rng.integers(3, vocab, 16).tolist(), Sampling(), 40, seed=1),
        Request(2, long_prompt, Sampling(), 16, seed=2),
    ]
    print(
        f"{args.model}: B=2 at -c {args.context}; a {args.prompt}-token prompt admitted while a row decodes "
        f"{args.running} tokens"
    )
    print(f"{'chunk':>6} {'ITL p50 ms':>11} {'max ms':>8} {'max/p50':>8} {'TTFT in job s':>14} {'TTFT alone s':>13}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        runner = Scheduler(batched, 2, args.context, Decoding(chunk))
        for _ in range(2):  # the first compiles
            records = {}
            runner.run(requests, lambda r: records.__setitem__(r["id"], r))
        itl = records[0]["timings"]["itl_ms"]
        engine = Engine(model.config, model.params, args.context, (), prefill_chunk=chunk)
        for first in (1, 2):  # the first compiles; a different first token: nothing reused from the cache
            stream = engine.generate([first] + long_prompt[1:], Sampling(), 1)
            list(stream)
        alone = stream.timings.ttft_s
        print(
            f"{chunk or 'off':>6} {itl['p50']:>11.1f} {itl['max']:>8.1f} {itl['max'] / itl['p50']:>8.1f} "
            f"{records[2]['timings']['ttft_s']:>14.2f} {alone:>13.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
