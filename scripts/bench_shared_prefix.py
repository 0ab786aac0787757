"""Requests that share a prompt's beginning, arriving together: one prefill between them
(`Scheduler._admit` copies a row's K/V to the others), against the same requests made distinct.

    python scripts/bench_shared_prefix.py                   # the bundled model
    python scripts/bench_shared_prefix.py -m MODEL [-r 5] [-b 8] [-n 16]

`--requests` questions after one system prompt of ~160 tokens, each `--tokens` greedy tokens, over
`--batch` slots that hold nothing at the start of a round; the baseline is the same job with a
word that differs per request put before the system prompt (the same lengths, nothing to share).
Rounds alternate; medians of the job's wall time, the requests' TTFT p50 and the prompt tokens
taken from a cache are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxinfer.kernel import isa
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler

SYSTEM = "You are a helpful assistant for a Python code base. Answer with code only, no prose. " * 6
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("-b", "--batch", type=int, default=8)
    parser.add_argument("-q", "--requests", type=int, default=16)
    parser.add_argument("-n", "--tokens", type=int, default=16)
    args = parser.parse_args()
    model = load_model(args.model)

    def job(shared: bool) -> list[Request]:
        return [
            Request(
                i,
                model.tokenizer.encode(
                    ("" if shared else f"{WORDS[i % len(WORDS)]} {i}. ")
                    + SYSTEM
                    + f"Write a function number {i} that adds {i} to its argument."
                ),
                Sampling(),
                args.tokens,
                seed=i,
            )
            for i in range(args.requests)
        ]

    jobs = {"shared": job(True), "distinct": job(False)}
    longest = max(len(r.prompt_ids) for rs in jobs.values() for r in rs)
    scheduler = Scheduler(model, args.batch, 1 << (longest + args.tokens).bit_length())

    def run(name: str) -> tuple[float, float, int]:
        scheduler.forget()  # no row holds anything: arrivals are cold
        before = scheduler.stats.cached_tokens
        records = []
        started = time.perf_counter()
        scheduler.run(jobs[name], records.append)
        seconds = time.perf_counter() - started
        ttft = statistics.median(r["timings"]["ttft_s"] for r in records)
        return seconds, ttft, scheduler.stats.cached_tokens - before

    for _ in range(2):  # compile every program either job needs
        run("shared"), run("distinct")
    results = {name: [] for name in jobs}
    for _ in range(args.rounds):
        for name in jobs:
            results[name].append(run(name))
    prompt_tokens = sum(len(r.prompt_ids) for r in jobs["shared"])
    print(
        f"{model.path.name}, {args.requests} requests of ~{prompt_tokens // args.requests} prompt tokens, "
        f"{args.tokens} tokens each, B={args.batch}, kernels {isa()}, {args.rounds} alternated rounds (median):"
    )
    for name, rows in results.items():
        seconds, ttft, cached = (statistics.median(column) for column in zip(*rows))
        print(f"  {name}: job {seconds * 1e3:.0f} ms, TTFT p50 {ttft * 1e3:.1f} ms, cached {cached:.0f} tokens")
    ratios = [d[0] / s[0] for s, d in zip(results["shared"], results["distinct"])]
    print(f"  distinct ÷ shared job time: ×{statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
