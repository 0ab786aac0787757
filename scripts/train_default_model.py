"""Train jaxinfer's bundled default model: a small Llama on the Python standard library's own source.

Reproducible from any machine with Python ≥ 3.11 and `pip install -e ".[train]"`:

    python scripts/train_default_model.py --out models/stdlib-llama-11m

Everything comes from the running interpreter's stdlib (its test suites, generated codec tables and
pydoc topics left out): a sentencepiece tokenizer (BPE, byte fallback, whitespace and newlines kept
exactly, so code round-trips) and the model, trained with jaxinfer's own `forward` (the code `run`
executes) and optax. Validation is a held-out set of whole files. The output is a standard Hugging Face
Llama directory (bfloat16 safetensors) with a model card and its loss curves.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sentencepiece as spm

from jaxinfer import model, weights
from jaxinfer.families import config_from_hf
from jaxinfer.forms import Plain, is_form

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"}


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts))
    return root, files


def is_validation(relative: Path, fraction: float) -> bool:
    """A stable split by file: the same files are held out on every machine and every run."""
    digest = hashlib.sha256(str(relative).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def train_tokenizer(texts: list[str], vocab_size: int) -> bytes:
    def blocks():  # multi-line training "sentences", so newlines and indentation become pieces
        for text in texts:
            lines = text.splitlines(keepends=True)
            for i in range(0, len(lines), 40):
                yield "".join(lines[i : i + 40])

    model_file = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=blocks(),
        model_writer=model_file,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        max_sentence_length=1 << 16,
        character_coverage=0.9999,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
    )
    return model_file.getvalue()


def encode(sp: spm.SentencePieceProcessor, texts: list[str]) -> np.ndarray:
    """Each file as <s> text </s>, concatenated: the stream training windows are cut from."""
    ids = [[sp.bos_id(), *sp.encode(text), sp.eos_id()] for text in texts]
    return np.concatenate([np.asarray(x, np.uint16) for x in ids])


def hf_config(args: argparse.Namespace) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.dim // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.context,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def init_params(cfg, key: jax.Array) -> dict:
    """GPT-2 style: N(0, 0.02), residual projections scaled down by √(2·layers); norms at 1."""
    table = weights.weight_table(cfg)
    keys = jax.random.split(key, len(table))
    leaves = {}
    for k, (path, shape, *_) in zip(keys, table.values()):
        if len(shape) == 1:
            leaves[path] = jnp.ones(shape, jnp.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg.num_layers) if path[-1] in ("wo", "wdown") else 0.02
            leaves[path] = Plain(std * jax.random.normal(k, shape, jnp.float32))
    return weights.tree_from_leaves(cfg, leaves)


def loss_fn(params: dict, cfg, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over batch [B, T+1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    hidden, _ = model.forward(params, cfg, inputs, positions, None, inputs.shape[1])
    return optax.softmax_cross_entropy_with_integer_labels(model.logits(params, hidden, cfg), targets).mean()


def save_safetensors(params: dict, cfg, path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = {}
    for name, (tree_path, *_) in weights.weight_table(cfg).items():
        leaf = params
        for key in tree_path:
            leaf = leaf[key]
        tensors[name] = np.asarray(jnp.asarray(leaf.dense() if is_form(leaf) else leaf, jnp.bfloat16))
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_model_dir(out: Path, args, config: dict, tokenizer: bytes, params: dict, cfg) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.model").write_bytes(tokenizer)
    tokenizer_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "add_prefix_space": False,
        "legacy": False,
        "model_max_length": args.context,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    # greedy, with a mild repetition penalty: a model this small loops without one
    generation = {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "do_sample": False,
        "repetition_penalty": 1.2,
        "max_new_tokens": 128,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_safetensors(params, cfg, out / "model.safetensors")


def plot_losses(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = [h for h in history if "train_loss" in h]
    val = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in train], [h["train_loss"] for h in train], label="train", lw=1)
    ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation", ms=3)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", ylim=(0, None), title="Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def evaluate(eval_loss, params, windows: np.ndarray, batch: int) -> float:
    losses = [float(eval_loss(params, jnp.asarray(windows[i : i + batch]))) for i in range(0, len(windows), batch)]
    return float(np.mean(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--eval-windows", type=int, default=64, help="validation windows in periodic evals (all at the end)"
    )
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.time()

    root, files = stdlib_files()
    split = {False: [], True: []}
    for f in files:
        split[is_validation(f.relative_to(root), args.val_fraction)].append(
            f.read_text(encoding="utf-8", errors="replace")
        )
    train_texts, val_texts = split[False], split[True]
    tokenizer = train_tokenizer(train_texts, args.vocab)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer)
    train_ids, val_ids = encode(sp, train_texts), encode(sp, val_texts)
    val_bytes = sum(len(t.encode()) for t in val_texts)
    print(
        f"corpus: {root}, {len(train_texts)} train / {len(val_texts)} validation files, "
        f"{len(train_ids):,} / {len(val_ids):,} tokens",
        file=sys.stderr,
    )

    config = hf_config(args)
    cfg = config_from_hf(config)
    params = init_params(cfg, jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps, end_value=args.lr / 10)
    decay_mask = jax.tree.map(lambda x: x.ndim == 2, params)  # no weight decay on norms
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    )
    opt_state = optimizer.init(params)

    @jax.jit
    def eval_loss(params, batch):
        return loss_fn(params, cfg, batch)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))

    span = args.context + 1
    val_windows = val_ids[: len(val_ids) // span * span].reshape(-1, span).astype(np.int32)
    rng = np.random.default_rng(args.seed)
    history, tokens_seen, train_started = [], 0, time.time()
    for i in range(1, args.steps + 1):
        starts = rng.integers(0, len(train_ids) - span, args.batch)
        batch = np.stack([train_ids[s : s + span] for s in starts]).astype(np.int32)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
        tokens_seen += args.batch * args.context
        history.append({"step": i, "train_loss": float(loss)})
        if i % 10 == 0:
            elapsed = time.time() - train_started
            print(
                f"step {i}/{args.steps} loss {float(loss):.3f} {tokens_seen / elapsed:,.0f} tok/s "
                f"elapsed {elapsed / 60:.1f} min",
                file=sys.stderr,
                flush=True,
            )
        if i % args.eval_every == 0 or i == args.steps:
            windows = val_windows if i == args.steps else val_windows[: args.eval_windows]
            history.append({"step": i, "val_loss": evaluate(eval_loss, params, windows, args.batch)})
            print(f"step {i} validation loss {history[-1]['val_loss']:.3f}", file=sys.stderr, flush=True)
    train_seconds = time.time() - train_started

    val_loss = history[-1]["val_loss"]
    # bits per byte of the whole held-out set: nats/token → bits, times tokens per byte
    bits_per_byte = val_loss / math.log(2) * len(val_ids) / val_bytes
    write_model_dir(args.out, args, config, tokenizer, params, cfg)
    plot_losses(history, args.out / "loss.png")
    report = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "train_files": len(train_texts),
        "validation_files": len(val_texts),
        "train_tokens": int(len(train_ids)),
        "validation_tokens": int(len(val_ids)),
        "validation_bytes": val_bytes,
        "parameters": int(n_params),
        "tokens_seen": tokens_seen,
        "steps": args.steps,
        "train_seconds": round(train_seconds),
        "total_seconds": round(time.time() - started),
        "machine": f"{platform.processor() or platform.machine()}, {jax.device_count()} {jax.default_backend()} "
        "device(s), "
        f"{__import__('os').cpu_count()} cores",
        "final_train_loss": float(np.mean([h["train_loss"] for h in history if "train_loss" in h][-50:])),
        "validation_loss": val_loss,
        "bits_per_byte": bits_per_byte,
        "args": {k: str(v) for k, v in vars(args).items()},
        "history": history,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
