"""jaxinfer on llama.cpp's own quantized GGUF files, judged against llama.cpp on the same files: the
perplexity each engine gives held-out text, and how often jaxinfer's next token is llama.cpp's.

    pip install -e ".[compare]"        # llama-cpp-python: the converter's source, its quantizer, its answers
    python scripts/gguf_quality.py     # prints one JSON line per file, then a Markdown table

The bundled model (trained, so its distributions are not a random model's) becomes an F32 GGUF by
llama.cpp's `convert_hf_to_gguf.py`, then Q8_0 by the converter and Q4_0, Q4_K_M, Q5_K_M, Q6_K by
`llama_model_quantize`. Both engines score the same token windows (`jaxinfer.perplexity.windows`:
`--context` tokens, advancing by half of it) of the held-out text: this repository's own Python, which
the model never saw. llama.cpp runs with a float32 KV cache, so only the weights' handling differs.
"exact weights" is jaxinfer with its kernels off: the file's values dequantized into XLA's float32
products, without the kernels' int8 activations (where the two engines part, if not in the weights).

    python scripts/gguf_quality.py --model DIR --kinds Q4_K_M    # any Hugging Face directory
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from compare_peers import llama_cpp_source  # noqa: E402

KINDS = ("F32", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
FTYPES = {"Q4_0": 2, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}  # llama.h's LLAMA_FTYPE_MOSTLY_*


def files(work: Path, model: Path | None = None, kinds=KINDS) -> dict[str, Path]:
    """The model (None: the bundled one) as a GGUF file of each kind, made by llama.cpp (once, kept in `work`)."""
    import subprocess

    import llama_cpp

    from jaxinfer.modeldir import bundled_model_dir

    tree = llama_cpp_source(Path(tempfile.gettempdir()))
    model = model or bundled_model_dir()
    out = {kind: work / f"{model.name}.{kind}.gguf" for kind in ("F32", *kinds)}
    for kind, outtype in (("F32", "f32"), ("Q8_0", "q8_0")):
        if kind in out and not out[kind].is_file():
            command = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model)]
            command += ["--outtype", outtype, "--outfile", str(out[kind])]
            subprocess.run(command, check=True, env={"PYTHONPATH": str(tree / "gguf-py")})
    for kind, ftype in FTYPES.items():
        if kind in out and not out[kind].is_file():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            if llama_cpp.llama_model_quantize(str(out["F32"]).encode(), str(out[kind]).encode(), params) != 0:
                raise RuntimeError(f"llama_model_quantize {kind} failed")
    return out


def log_probs_llama_cpp(path: Path, window: list[int]) -> np.ndarray:
    """llama.cpp's log-probabilities [T-1, V] of each next token of `window`."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=len(window), n_batch=len(window), logits_all=True, verbose=False, type_k=0, type_v=0
    )
    llm.eval(window[:-1])
    logits = np.array(llm.scores[: len(window) - 1], np.float64)
    return (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )


def log_probs_ours(model, window: list[int]) -> np.ndarray:
    import jax.numpy as jnp

    from jaxinfer.perplexity import _window_logprobs

    return np.asarray(_window_logprobs(model.params, jnp.asarray(window), model.config), np.float64)


def score(log_probs, spans: list[tuple[list[int], int]]) -> tuple[float, list[np.ndarray]]:
    """The negative log-likelihood of the spans' scored tokens (each a window and where its scored
    part starts) under `log_probs(window)`, and each span's top-1 tokens."""
    nll, top = 0.0, []
    for window, start in spans:
        lp = log_probs(window)[start:]
        targets = np.asarray(window[1:])[start:]
        nll -= lp[np.arange(len(targets)), targets].sum()
        top.append(lp.argmax(-1))
    return nll, top


def judge(path: Path, ids: list[int], context: int) -> dict:
    """Both engines' perplexity on the file, and jaxinfer's with its kernels off ("exact weights": the
    file's values dequantized, XLA's float32 products, no int8 activations). Each of jaxinfer's two
    runs scores every window in turn, so each compiles once."""
    import jax

    from jaxinfer import kernel
    from jaxinfer.loading import load_model
    from jaxinfer.perplexity import windows

    spans = [(ids[w.start : w.start + context], w.scored_from - 1) for w in windows(len(ids), context, context // 2)]
    model = load_model(path)
    nll, top = {}, {}
    nll["jaxinfer"], top["jaxinfer"] = score(lambda window: log_probs_ours(model, window), spans)
    kernel.enabled = False
    jax.clear_caches()  # the programs compiled with the kernels
    try:
        exact = load_model(path)
        nll["exact weights"], _ = score(lambda window: log_probs_ours(exact, window), spans)
    finally:
        kernel.enabled = True
        jax.clear_caches()
    nll["llama.cpp"], top["llama.cpp"] = score(lambda window: log_probs_llama_cpp(path, window), spans)
    scored = sum(len(t) for t in top["jaxinfer"])
    agree = sum(int((a == b).sum()) for a, b in zip(top["jaxinfer"], top["llama.cpp"]))
    ppl = {engine: float(np.exp(total / scored)) for engine, total in nll.items()}
    return {
        "file": path.name,
        "storage": model.storage,
        "tokens": scored,
        "perplexity": ppl,
        "ratio": ppl["jaxinfer"] / ppl["llama.cpp"],
        "top1_agreement": agree / scored,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "jaxinfer-gguf-quality")
    parser.add_argument(
        "--model", type=Path, default=None, help="a Hugging Face directory [default: the bundled model]"
    )
    parser.add_argument("--kinds", default=",".join(KINDS[1:]), help="the quantized kinds beside F32")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from jaxinfer.loading import load_model

    made = files(args.work, args.model, tuple(args.kinds.split(",")))
    text = "\n".join(p.read_text() for p in sorted((ROOT / "jaxinfer").glob("*.py")))
    ids = load_model(made["F32"]).tokenizer.encode(text)[: args.tokens]
    rows = []
    for kind, path in made.items():
        rows.append(judge(path, ids, args.context))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| file | jaxinfer runs it as | perplexity, jaxinfer | exact weights | llama.cpp | ratio | top-1 agreement |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        p = r["perplexity"]
        print(
            f"| {r['file']} | {r['storage']} | {p['jaxinfer']:.4f} | {p['exact weights']:.4f} | {p['llama.cpp']:.4f} "
            f"| {r['ratio']:.4f} | {r['top1_agreement']:.1%} |"
        )


if __name__ == "__main__":
    main()
