"""What a constraint costs decode: a constrained row against a free one, and free rows beside a
constrained batch-mate against the same rows in a batch without one (`jaxinfer.constrain`).

    python scripts/bench_constrained.py                       # the bundled model
    python scripts/bench_constrained.py -m MODEL [-n 128] [-r 3]
    python scripts/bench_constrained.py --speculate           # a constrained row drafting, against plain


Every row runs `-n` tokens (EOS ignored; the constraint, a regular expression of words, never
completes), greedy, rounds alternated; the medians of decode tok/s (after the first token) are
printed, and the median of each round's ratio. The issue's bars: a constrained row ≥ 0.8× a free one; free batch-mates
≥ 0.95×. With `--speculate`: one JSON schema (an array of 12 small objects) after a prompt that
shows such arrays, the constrained row with prompt-lookup drafts (`Speculation(4)`) against plain
constrained steps: the same text, decode tok/s and tokens a pass.
"""

from __future__ import annotations

import argparse
import statistics

from jaxinfer.constrain import Constraint
from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.kernel import isa
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.scheduler import Request, Scheduler
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation

WORDS = Constraint("regex", r"([a-z]+ )+")  # never complete: each row runs its whole budget
PROMPT = "The list of the words we keep:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", "--tokens", type=int, default=128)
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("-b", "--batch", type=int, default=4)
    parser.add_argument("--speculate", action="store_true")
    args = parser.parse_args()
    model = load_model(args.model)
    if args.speculate:
        return speculation(model, args.rounds)
    prompt = model.tokenizer.encode(PROMPT)
    context = 1 << (len(prompt) + args.tokens).bit_length()
    # apart: once a constraint has run, an engine's programs hold the callback (rows without one pay it too)
    engines = {c: Engine(model.config, model.params, context, model.eos_ids) for c in (None, WORDS)}

    def alone(constraint) -> float:
        engine = engines[constraint]
        gen = Generation(model, engine, prompt, Sampling(), args.tokens, 0, ignore_eos=True, constraint=constraint)
        list(gen)
        return gen.timings.decode_tok_s

    def batch(constrained: bool) -> float:
        """The free rows' median decode tok/s, beside one constrained row or a free one."""
        requests = [
            Request(
                i,
                prompt,
                Sampling(),
                args.tokens,
                i,
                ignore_eos=True,
                constraint=WORDS if constrained and i == 0 else None,
            )
            for i in range(args.batch)
        ]
        records = []
        runners[constrained].run(requests, records.append)
        return statistics.median(r["timings"]["decode_tok_s"] for r in records if r["id"] != 0)

    runners = {c: Scheduler(model, args.batch, context) for c in (False, True)}
    alone(WORDS), alone(None), batch(True), batch(False)  # compile every program first
    rows = {
        "free row": [],
        "constrained row": [],
        "free batch-mates, no constraint": [],
        "beside a constrained row": [],
    }
    for _ in range(args.rounds):  # alternated: this machine's speed drifts by tens of % between minutes
        rows["free row"].append(alone(None))
        rows["constrained row"].append(alone(WORDS))
        rows["free batch-mates, no constraint"].append(batch(False))
        rows["beside a constrained row"].append(batch(True))
    print(f"{model.path.name}, {args.tokens} tokens, kernels {isa()}, {args.rounds} alternated rounds (median):")
    for name, values in rows.items():
        print(f"  {name}: {statistics.median(values):.1f} tok/s")
    for label, (mine, base) in {
        "constrained ÷ free": ("constrained row", "free row"),
        f"free batch-mates (B={args.batch}) beside a constrained row ÷ without": (
            "beside a constrained row",
            "free batch-mates, no constraint",
        ),
    }.items():
        ratios = [a / b for a, b in zip(rows[mine], rows[base])]
        print(f"  {label}: ×{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


def speculation(model, rounds: int) -> None:
    item = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["point", "line"]}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    }
    array = Constraint("json_schema", {"type": "array", "items": item, "minItems": 12, "maxItems": 12})
    example = '[{"id":1,"kind":"point"},{"id":2,"kind":"point"},{"id":3,"kind":"line"}]'
    prompt = model.tokenizer.encode(f"import json\n\nA = {example}\nB = {example}\nC = ")
    decodings = {"plain": Decoding(), "ngram": Decoding(speculation=Speculation(4))}
    engines = {name: Engine(model.config, model.params, 512, model.eos_ids, d) for name, d in decodings.items()}

    def go(name: str) -> Generation:
        gen = Generation(model, engines[name], prompt, Sampling(), 300, 0, constraint=array)
        list(gen)
        return gen

    go("plain"), go("ngram")  # compile
    rates = {name: [] for name in engines}
    for _ in range(rounds):
        for name in engines:
            rates[name].append(go(name).timings.decode_tok_s)
    plain, drafted = go("plain"), go("ngram")
    assert drafted.token_ids == plain.token_ids, "speculation changed a constrained row's tokens"
    per_pass = drafted.result()["timings"]["speculation"]["tokens_per_step"]
    ratios = [a / b for a, b in zip(rates["ngram"], rates["plain"])]
    print(f"{model.path.name}, {len(plain.token_ids)} tokens of JSON, kernels {isa()}, {rounds} alternated rounds:")
    print(f"  plain constrained: {statistics.median(rates['plain']):.1f} tok/s")
    print(f"  drafting (ngram, K=4): {statistics.median(rates['ngram']):.1f} tok/s, {per_pass} tokens a pass")
    print(f"  drafting ÷ plain: ×{statistics.median(ratios):.2f} (the same tokens)")


if __name__ == "__main__":
    main()
