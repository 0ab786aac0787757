"""What prompt-lookup speculation buys: decode tok/s with and without `--speculate ngram`, same
engine settings, same process, alternated over repeats (median), on a prompt whose continuation
repeats text already there (copy-heavy) and on open-ended ones.

    python scripts/bench_speculation.py --model bundled --draft 2,4,8
    python scripts/bench_speculation.py --model smollm-135m --quantize int8
    python scripts/bench_speculation.py --draft-model --layers 48 --scale 0,0.3 --draft 2,4

The bundled model (trained on Python's standard library) is asked to write out again a function
from its prompt; an open-ended prompt asks for new code. Random-weight shapes have no text to copy:
their greedy output falls into loops within a few dozen tokens, which lookup predicts, so their
copy-heavy figure is the best case and their open-ended one (a prompt of random ids, sampled at
temperature 1) is the worst.

With --draft-model the bundled model drafts for a deeper model shaped from it (`shapes.deepened`:
its six layers, then copies of them up to --layers with their output projections scaled by
--scale): at scale 0 the target's tokens are the draft's (every draft kept: the mechanism's
ceiling at that cost ratio), and larger scales make it disagree more, as a bigger model trained on
the same text would.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap

import numpy as np
from shapes import SHAPES, deepened, loaded

from jaxinfer import quant
from jaxinfer.engine import Engine
from jaxinfer.loading import load_model
from jaxinfer.sampling import Sampling
from jaxinfer.slots import Decoding
from jaxinfer.state import Speculation


def bundled_prompts(model) -> dict[str, tuple[list[int], Sampling]]:
    source = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))[:700]
    head = source.split("\n", 1)[0]
    encode = model.tokenizer.encode
    return {
        "copy-heavy": (encode(f"{source}\n\n# The same, once more:\n{head}\n"), Sampling()),
        "open-ended": (encode("import os\n\n\ndef walk_tree(root):\n"), Sampling()),
        "open, sampled": (encode("import os\n\n\ndef walk_tree(root):\n"), Sampling(temperature=0.8, top_p=0.95)),
        # issue 60's: text that repeats little (×0.63 of plain decoding before the back-off)
        "novel": (encode("def fibonacci(n):"), Sampling()),
        "novel, sampled": (encode("def fibonacci(n):"), model.sampling),  # as `jaxinfer run` samples it
    }


def shape_prompts(vocab: int) -> dict[str, tuple[list[int], Sampling]]:
    ids = np.random.default_rng(0).integers(3, vocab, 64).tolist()
    return {"loops (greedy)": (ids, Sampling()), "random (T=1)": (ids, Sampling(temperature=1.0))}


def decode_tok_s(engine: Engine, prompt: list[int], sampling: Sampling, tokens: int) -> tuple[float, dict]:
    run = engine.generate(prompt, sampling, tokens, seed=0, stream=False, ignore_eos=True)
    for _ in run:
        pass
    spec = run.timings.speculation
    return run.timings.decode_tok_s, spec.as_dict() if spec else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["bundled", *sorted(SHAPES)], default="bundled")
    parser.add_argument("--draft", default="4", help="draft lengths K to compare, comma-separated")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quantize", choices=quant.METHODS, default=None)
    parser.add_argument(
        "--draft-model", action="store_true", help="the bundled model drafts for a deeper one made from it"
    )
    parser.add_argument("--layers", type=int, default=48, help="with --draft-model: the target's layers")
    parser.add_argument(
        "--scale", default="0,0.3", help="with --draft-model: the added layers' output scales to compare"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    drafts = [int(k) for k in args.draft.split(",")]
    if args.draft_model:
        if args.quantize or args.model != "bundled":
            parser.error("--draft-model shapes a float32 target from the bundled model: no --model or --quantize")
        draft = load_model(None)
        source = load_model(None, layout="out_in")
        prompts = bundled_prompts(draft)
        rows = []
        for scale in map(float, args.scale.split(",")):
            cfg, params = deepened(source.config, source.params, args.layers, scale)
            engines = {0: Engine(cfg, params, 512, eos_ids=())} | {
                k: Engine(
                    cfg,
                    params,
                    512,
                    eos_ids=(),
                    decoding=Decoding(speculation=Speculation(draft=k, model=draft.config), draft_params=draft.params),
                )
                for k in drafts
            }
            rows += [{"scale": scale, **row} for row in compare(engines, prompts, args.tokens, args.repeat)]
        report(rows, args, f"the bundled model drafting for {args.layers} layers made from it")
        return
    if args.model == "bundled":
        model = load_model(None, quantize=args.quantize)
        cfg, params, prompts, context = model.config, model.params, bundled_prompts(model), 512
    else:
        cfg = SHAPES[args.model]
        params = loaded(cfg, args.quantize)
        prompts, context = shape_prompts(cfg.vocab_size), 1024
    engines = {
        k: Engine(cfg, params, context, eos_ids=(), decoding=Decoding(speculation=Speculation(draft=k)))
        for k in [0, *drafts]
    }
    report(
        compare(engines, prompts, args.tokens, args.repeat),
        args,
        f"{args.model} ({cfg.architecture}, {args.quantize or 'float32'})",
    )


def compare(engines: dict[int, Engine], prompts: dict, tokens: int, repeat: int) -> list[dict]:
    """Each prompt on each engine (key: K, 0 plain), alternated over repeats; medians."""
    rows = []
    for name, (prompt, sampling) in prompts.items():
        for engine in engines.values():  # compile every program the runs need before timing
            decode_tok_s(engine, prompt, sampling, tokens)
        speeds = {k: [] for k in engines}
        stats = {}
        for _ in range(repeat):
            for k, engine in engines.items():
                tok_s, stats[k] = decode_tok_s(engine, prompt, sampling, tokens)
                speeds[k].append(tok_s)
        plain = statistics.median(speeds[0])
        for k in [k for k in speeds if k]:
            fast = statistics.median(speeds[k])
            rows.append(
                {
                    "prompt": name,
                    "draft": k,
                    "plain_tok_s": round(plain, 1),
                    "speculative_tok_s": round(fast, 1),
                    "speedup": round(fast / plain, 3),
                    **stats[k],
                }
            )
    return rows


def report(rows: list[dict], args, what: str) -> None:
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{what}, {args.tokens} tokens, median of {args.repeat}")
    for r in rows:
        scale = f"scale {r['scale']}: " if "scale" in r else ""
        print(
            f"  {scale}{r['prompt']:15} K={r['draft']}: {r['plain_tok_s']:7.1f} → {r['speculative_tok_s']:7.1f} tok/s "
            f"(×{r['speedup']:.2f}); accepted {r['accepted']}/{r['drafted']} ({r['acceptance_rate']:.0%}), "
            f"{r['tokens_per_step']:.2f} tokens per step"
        )


if __name__ == "__main__":
    main()
