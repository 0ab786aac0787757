"""Write the model card (README.md) of a model trained by train_default_model.py.

    python scripts/model_card.py models/stdlib-llama-11m

Reads the figures the training run recorded (training.json), generates greedy samples with jaxinfer,
and measures `jaxinfer run` on this machine: time from launch to the first streamed token with a cold
and with a warm compilation cache, and the engine's own TTFT, compile time and decode speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxinfer.engine import Engine
from jaxinfer.generate import Generation
from jaxinfer.loading import load_model

SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
    "    def __repr__(self):",
    'def read_config(filename):\n    """',
)
BENCH_PROMPT = "def fibonacci(n):"
BENCH_TOKENS = 128


def samples(model_dir: Path) -> list[tuple[str, str]]:
    model = load_model(model_dir)
    engine = Engine(model.config, model.params, model.max_positions, model.eos_ids)
    out = []
    for prompt in SAMPLE_PROMPTS:
        gen = Generation(model, engine, model.tokenizer.encode(prompt), model.sampling, max_tokens=96)
        out.append((prompt, "".join(gen)))
    return out


def measure(model_dir: Path) -> dict:
    env_for = lambda cache: {**os.environ, "JAXINFER_CACHE_DIR": cache}  # noqa: E731
    command = [
        "jaxinfer",
        "run",
        "-m",
        str(model_dir),
        BENCH_PROMPT,
        "-n",
        str(BENCH_TOKENS),
        "--ignore-eos",
        "--temp",
        "0",
    ]
    figures = {}
    with tempfile.TemporaryDirectory() as cache:
        for phase in ("cold", "warm"):  # the first process compiles into the empty cache, the second reads it
            start = time.perf_counter()
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env_for(cache))
            proc.stdout.read(1)
            figures[f"{phase}_launch_to_first_token_s"] = time.perf_counter() - start
            proc.communicate()
            figures[f"{phase}_wall_s"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as cache:
        for phase in ("cold", "warm"):
            proc = subprocess.run(command + ["--json"], capture_output=True, text=True, env=env_for(cache), check=True)
            figures[phase] = json.loads(proc.stdout)["timings"]
    return figures


def loss_table(history: list[dict], every: int) -> str:
    train = {h["step"]: h["train_loss"] for h in history if "train_loss" in h}
    val = {h["step"]: h["val_loss"] for h in history if "val_loss" in h}
    rows = ["| step | train loss (mean of the last %d steps) | validation loss |" % every, "|---:|---:|---:|"]
    for step in sorted(val):
        window = [train[s] for s in range(max(1, step - every + 1), step + 1)]
        rows.append(f"| {step} | {sum(window) / len(window):.3f} | {val[step]:.3f} |")
    return "\n".join(rows)


def card(model_dir: Path, report: dict, config: dict, examples: list[tuple[str, str]], speed: dict) -> str:
    args = report["args"]
    name = model_dir.name
    hours, minutes = divmod(round(report["train_seconds"] / 60), 60)
    sample_text = "\n\n".join(f"Prompt `{p!r}`:\n\n```python\n{p}{c}\n```" for p, c in examples)
    cold, warm = speed["cold"], speed["warm"]
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, code, python, jaxinfer]
---

# {name}

jaxinfer's bundled default model: a {report["parameters"] / 1e6:.1f} M-parameter Llama trained from scratch
on the source code of the Python standard library, so that `jaxinfer run "def fibonacci(n):"` works on
a fresh machine with nothing to download. It writes Python-shaped code (indentation, `def`/`return`,
docstrings, mostly balanced brackets); it does not write correct programs. It is a smoke-test and demo
model, not an assistant.

It is a standard Hugging Face checkpoint: `transformers` runs it too, to the same greedy output
(jaxinfer's `tests/test_default_model.py` checks that token for token).

## Model

| | |
|---|---|
| architecture | `LlamaForCausalLM` (RMSNorm, SwiGLU, RoPE θ=10000, grouped-query attention, tied embeddings) |
| parameters | {report["parameters"]:,} |
| layers × hidden | {config["num_hidden_layers"]} × {config["hidden_size"]} (MLP {config["intermediate_size"]}) |
| heads | {config["num_attention_heads"]} query, {config["num_key_value_heads"]} key/value, \
head size {config["head_dim"]} |
| context | {config["max_position_embeddings"]} tokens (trained length) |
| vocabulary | {config["vocab_size"]} (sentencepiece BPE, byte fallback) |
| weights | bfloat16 safetensors ({(model_dir / "model.safetensors").stat().st_size / 2**20:.1f} MiB) |

## Data

The `.py` files of CPython {report["python"]}'s standard library (the interpreter that ran the
training), without its test suites (`test/`, `tests/`, `idle_test/`), the generated codec tables
(`encodings/`) and pydoc's topic strings (`pydoc_data/`). {report["validation_files"]} whole files
({report["validation_tokens"]:,} tokens, {report["validation_bytes"]:,} bytes) are held out for
validation, chosen by a hash of their path; {report["train_files"]} files ({report["train_tokens"]:,}
tokens) are for training.

The tokenizer is trained by the same script on the training files: BPE, {config["vocab_size"]} pieces,
byte fallback (any text can be encoded), identity normalisation, no dummy prefix, whitespace-only
pieces and `\\n` as a piece of its own, so code round-trips exactly, indentation included.

## Training

`python scripts/train_default_model.py --out models/{name}` (jaxinfer's own `forward`, the code
`jaxinfer run` executes, with optax): AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), peak
learning rate {args["lr"]} after {args["warmup"]} warm-up steps, cosine decay to a tenth, gradient
clipping at 1.0; {args["steps"]} steps of {args["batch"]} random windows of {args["context"]} tokens:
**{report["tokens_seen"]:,} tokens seen** ({report["tokens_seen"] / report["train_tokens"]:.1f} passes
over the training tokens). float32 throughout, bfloat16 for the saved weights.

Trained in **{hours} h {minutes:02d} min** on {report["machine"]} (no GPU).

## Results

| | |
|---|---|
| validation loss (all held-out files) | **{report["validation_loss"]:.3f}** nats/token |
| bits per byte (validation) | **{report["bits_per_byte"]:.3f}** |
| final train loss (mean of the last 50 steps) | {report["final_train_loss"]:.3f} nats/token |

![loss curves](loss.png)

{loss_table(report["history"], int(args["eval_every"]))}

Every step's train loss is in `training.json`.

## Speed in jaxinfer on the training machine

`jaxinfer run "{BENCH_PROMPT}" -n {BENCH_TOKENS} --ignore-eos --temp 0` (measured by
`scripts/model_card.py`), float32 compute (jaxinfer's `--dtype auto` on CPU):

| | cold (compiling) | warm (compilation cache hit) |
|---|---:|---:|
| launch → first token on stdout | {speed["cold_launch_to_first_token_s"]:.2f} s | \
{speed["warm_launch_to_first_token_s"]:.2f} s |
| compile | {cold["compile_s"]:.2f} s | {warm["compile_s"]:.2f} s |
| TTFT (prefill, compile excluded) | {cold["ttft_s"] * 1000:.0f} ms | {warm["ttft_s"] * 1000:.0f} ms |
| decode | {cold["decode_tok_s"]:.0f} tok/s | {warm["decode_tok_s"]:.0f} tok/s |

## Samples (the defaults: greedy, repetition penalty 1.2; up to 96 tokens)

{sample_text}

## Use

```bash
jaxinfer run "def fibonacci(n):"          # the default model
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("{name}")
model = AutoModelForCausalLM.from_pretrained("{name}")
ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=64, do_sample=False)[0]))
```

## Limitations

Tiny and trained for an hour on one corpus: it imitates the style of the standard library, invents
names and APIs, and knows nothing beyond Python source. The default in `generation_config.json` is
greedy decoding with a repetition penalty of 1.2 (without it, greedy text soon loops); it is
reproducible, and `--temp 0.7` gives livelier text.
"""


def main() -> None:
    model_dir = Path(sys.argv[1]).resolve()
    report = json.loads((model_dir / "training.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    text = card(model_dir, report, config, samples(model_dir), measure(model_dir))
    (model_dir / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
