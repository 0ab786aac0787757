"""jaxinfer against its peers on the same weights: transformers (PyTorch, CPU) and llama.cpp
(llama-cpp-python, built from its source distribution, whose vendored converter makes the GGUF).

    pip install -e ".[compare]"        # llama-cpp-python compiles llama.cpp: ~10 minutes on 2 cores
    python scripts/compare_peers.py    # prints the table and writes BENCHMARKS.md

On a CPU with AMX (Intel Sapphire Rapids and later) a native build of llama.cpp 0.3.36 dies with a
segmentation fault in its first q8_0 prefill (as in llama.cpp issue 20824, ggml_backend_amx_mul_mat);
build it for AVX-512 without AMX instead:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      pip install --force-reinstall --no-deps --no-cache-dir "llama-cpp-python==0.3.36"

Each shape (SmolLM-135M, TinyLlama-1.1B; `--shapes qwen3-moe-0.7b-a0.16b,qwen3-0.16b` a mixture of
experts beside a dense model of its active size, `gpt-oss-1.1b-a0.7b` gpt-oss's layers with
`--kinds mxfp4_moe`, `gemma4-e4b-1.3b` Gemma 4 E4B's layers, `--out` another file) becomes a random-weight float32
checkpoint made by transformers (with the bundled model's sentencepiece tokenizer; the converter pads its vocabulary),
converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py` (f32, f16, q8_0) and quantized to q4_0
and Q4_K_M (and a mixture's MXFP4_MOE) by llama.cpp's `llama_model_quantize`. Every engine and weight
format then runs the same 512 prompt tokens and 128 greedy new tokens on the same number of threads,
after a warm-up; the median of the repeats is kept. Prefill tokens/s = prompt tokens / time to the first token's logits;
decode tokens/s = generated tokens after the first / their time. Each peer row is compared with the
jaxinfer row of the same kind of weights: 32-bit with float32, 16-bit (f16, bfloat16) with our
bfloat16; llama.cpp's quantized files with jaxinfer running the same file (`-m FILE.gguf`). The int8
and int4 rows are jaxinfer's own quantization of the float32 checkpoint (`--quantize`), for reference.

The table replaces the first section of BENCHMARKS.md; the sections after it are kept.

`--alternate N` measures decode on a noisy machine: for each llama.cpp file, N rounds of jaxinfer on
it then llama.cpp on it, each loaded afresh, one run each after a warm-up; it prints each round's
ratio and their median, and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, hf_config  # noqa: E402

from jaxinfer.families import hybrid as hybrid_family  # noqa: E402
from jaxinfer.modeldir import bundled_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def checkpoint(shape: str, work: Path, dtype: str = "float32") -> Path:
    """A random-weight HF checkpoint of `shape` in `dtype` (made once, kept in `work`; on the GPU where
    there is one: the 8B shape in float32 would take 32 GB of host memory)."""
    import torch
    import transformers

    out = work / shape
    if any(out.glob("*.safetensors")):  # one file, or a large model's shards
        return out
    config = hf_config(SHAPES[shape], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(out)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, out / name)
    return out


def llama_cpp_source(work: Path) -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python source distribution of the installed version."""
    import llama_cpp

    version = llama_cpp.__version__
    tree = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not tree.is_dir():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(work),
                f"llama-cpp-python=={version}",
            ],
            check=True,
        )
        with tarfile.open(work / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(work, filter="data")
    return tree


# (engine, weights) rows per shape, and the jaxinfer weights each peer row is compared with
ROWS = [
    ("jaxinfer", "float32"),
    ("jaxinfer", "bfloat16"),
    ("jaxinfer", "int8"),
    ("jaxinfer", "int4"),
    ("jaxinfer", "q8_0 GGUF"),
    ("jaxinfer", "q4_0 GGUF"),
    ("jaxinfer", "q4_k_m GGUF"),
    ("jaxinfer", "mxfp4_moe GGUF"),
    ("transformers", "float32"),
    ("transformers", "bfloat16"),
    ("llama.cpp", "f32"),
    ("llama.cpp", "f16"),
    ("llama.cpp", "q8_0"),
    ("llama.cpp", "q4_0"),
    ("llama.cpp", "q4_k_m"),
    ("llama.cpp", "mxfp4_moe"),
]
# a quantized llama.cpp row against jaxinfer running the same GGUF file
OURS_FOR = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "f32": "float32",
    "f16": "bfloat16",
    "q8_0": "q8_0 GGUF",
    "q4_0": "q4_0 GGUF",
    "q4_k_m": "q4_k_m GGUF",
    "mxfp4_moe": "mxfp4_moe GGUF",
}
# llama.h's LLAMA_FTYPE_MOSTLY_*; MXFP4_MOE: a mixture's experts MXFP4, its other matrices Q8_0
QUANTIZED_BY_LLAMA_CPP = {"q4_0": 2, "q4_k_m": 15, "mxfp4_moe": 38}


def gguf(model_dir: Path, work: Path, kind: str) -> Path:
    """The checkpoint as a GGUF of `kind` (f32, f16, q8_0 by the converter; q4_0, q4_k_m quantized from f32)."""
    out = model_dir / f"model-{kind}.gguf"
    if out.is_file():
        return out
    if kind in QUANTIZED_BY_LLAMA_CPP:
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = QUANTIZED_BY_LLAMA_CPP[kind]
        if llama_cpp.llama_model_quantize(str(gguf(model_dir, work, "f32")).encode(), str(out).encode(), params) != 0:
            raise RuntimeError("llama_model_quantize failed")
        return out
    convert(model_dir, out, kind, "sentencepiece", llama_cpp_source(work))
    return out


# llama.cpp's converter as it ships, told what tokenizer it reads: "sentencepiece" (the shapes carry
# the bundled model's, which its Qwen mixtures would look for as a byte-level BPE tokenizer.json), or
# the pre-tokenizer a tiny BPE one was made with (it knows real ones by a hash of their output).
CONVERT = """
import sys
tree, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [tree, tree + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
import conversion.base
model = conversion.base.TextModel
if pre == "sentencepiece":
    model.set_vocab = model._set_vocab_sentencepiece
    import conversion.gemma, conversion.gpt_oss  # which choose their own (a BPE tokenizer.json)
    conversion.gpt_oss.GptOssModel.set_vocab = model._set_vocab_sentencepiece
    conversion.gemma.Gemma4Model.set_vocab = model._set_vocab_sentencepiece
else:
    model.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(model_dir: Path, out: Path, outtype: str, pre: str, tree: Path) -> None:
    """llama.cpp's `convert_hf_to_gguf.py` of `tree` on a checkpoint (`pre`: as `CONVERT` reads it).
    A Qwen hybrid's converter expects the hub's multi-token-prediction head, which random
    checkpoints lack: told so (`--no-mtp`)."""
    hybrid = json.loads((model_dir / "config.json").read_text())["architectures"][0] in hybrid_family.ARCHITECTURES
    command = [sys.executable, "-c", CONVERT, str(tree), pre, str(model_dir), "--outtype", outtype]
    subprocess.run(
        command + ["--outfile", str(out)] + ["--no-mtp"] * hybrid,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    )


def run_jaxinfer(model_dir: Path, prompt: list[int], new: int, repeat: int, weights: str) -> tuple[float, float]:
    from jaxinfer.engine import Engine
    from jaxinfer.loading import load_model
    from jaxinfer.sampling import Sampling

    if weights.endswith(" GGUF"):  # llama.cpp's own file, its matrices as it holds them, a 16-bit cache as its
        model = load_model(model_dir / f"model-{weights.split()[0]}.gguf", kv_dtype="bfloat16")
    else:
        dtype, quantize = (weights, None) if weights in ("float32", "bfloat16") else ("float32", weights)
        model = load_model(model_dir, dtype, quantize=quantize)
    results = []
    for _ in range(repeat + 1):  # the first compiles and warms up
        engine = Engine(model.config, model.params, len(prompt) + new, eos_ids=())  # an empty cache: no reuse
        run = engine.generate(prompt, Sampling(), new, seed=0, stream=False)
        list(run)
        results.append((len(prompt) / run.timings.ttft_s, run.timings.decode_tok_s))
    return _medians(results[1:])


def run_transformers(
    model_dir: Path, prompt: list[int], new: int, repeat: int, threads: int, weights: str
) -> tuple[float, float]:
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, weights)).eval()
    ids = torch.tensor([prompt])
    results = []
    with torch.no_grad():
        for _ in range(repeat + 1):
            start = time.perf_counter()
            model(ids, use_cache=True)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            total = time.perf_counter() - start
            results.append((len(prompt) / prefill, (new - 1) / (total - prefill)))
    return _medians(results[1:])


def run_llama_cpp(gguf_file: Path, prompt: list[int], new: int, repeat: int, threads: int) -> tuple[float, float]:
    from llama_cpp import Llama, llama_get_logits

    llm = Llama(
        str(gguf_file),
        n_ctx=len(prompt) + new,
        n_batch=len(prompt),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    results = []
    for _ in range(repeat + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new - 1):  # greedy on the logits of the last token evaluated
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))))])
        results.append((len(prompt) / prefill, (new - 1) / (time.perf_counter() - start)))
    return _medians(results[1:])


def alternate(shape: str, model_dir: Path, file: Path, prompt: list[int], args, kind: str) -> None:
    """Decode in alternated rounds, jaxinfer then llama.cpp on one file (`--alternate`)."""
    ratios = []
    for i in range(args.alternate):
        ours = run_jaxinfer(model_dir, prompt, args.tokens, 1, OURS_FOR[kind])[1]
        theirs = run_llama_cpp(file, prompt, args.tokens, 1, args.threads)[1]
        ratios.append(ours / theirs)
        print(
            f"{shape} {kind} round {i}: jaxinfer {ours:.2f}, llama.cpp {theirs:.2f} tok/s, ×{ratios[-1]:.3f}",
            flush=True,
        )
    print(f"{shape} {kind}: median jaxinfer ÷ llama.cpp ×{statistics.median(ratios):.3f} over {len(ratios)} rounds")


def _medians(results: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def versions() -> str:
    """The engines' versions, and the paths each took on this CPU: jaxinfer's kernels (`JAXINFER_ISA`
    caps them) and the instruction sets llama.cpp was built for."""
    import jax
    import llama_cpp
    import torch
    import transformers

    from jaxinfer import kernel

    built = [
        part.split("=")[0].strip()
        for part in llama_cpp.llama_print_system_info().decode().split("|")
        if part.strip().endswith("= 1")
    ]
    return (
        f"jax {jax.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"llama-cpp-python {llama_cpp.__version__}; jaxinfer's kernels: {kernel.isa()}; llama.cpp built with "
        f"{' '.join(b for b in built if b.startswith(('AVX', 'FMA', 'F16C', 'AMX', 'NEON', 'SVE')))}"
    )


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm-135m,tinyllama-1.1b")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", default="jaxinfer,transformers,llama.cpp", help="the engines' rows to run")
    parser.add_argument("--kinds", help="only these peers' weights (f32,q8_0,...) and jaxinfer's rows beside them")
    parser.add_argument("--work", type=Path, default=Path("/tmp/jaxinfer-peers"))
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--alternate", type=int, metavar="N", help="N alternated rounds against llama.cpp's files")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    prompt = np.random.default_rng(0).integers(3, 4096, args.prompt).tolist()
    if args.alternate:
        for shape in args.shapes.split(","):
            model_dir = checkpoint(shape, args.work)
            for kind in args.kinds.split(",") if args.kinds else QUANTIZED_BY_LLAMA_CPP:
                alternate(shape, model_dir, gguf(model_dir, args.work, kind), prompt, args, kind)
        return
    rows = []
    for shape in args.shapes.split(","):
        model_dir = checkpoint(shape, args.work)
        rates = {}
        kinds = args.kinds.split(",") if args.kinds else list(OURS_FOR)
        wanted = {OURS_FOR[kind] for kind in kinds} | set(kinds) if args.kinds else {w for _, w in ROWS}
        for engine, weights in ROWS:
            if engine not in args.engines.split(",") or weights not in wanted:
                continue
            if engine == "jaxinfer":
                if weights.endswith(" GGUF"):
                    gguf(model_dir, args.work, weights.split()[0])
                rates[engine, weights] = run_jaxinfer(model_dir, prompt, args.tokens, args.repeat, weights)
            elif engine == "transformers":
                rates[engine, weights] = run_transformers(
                    model_dir, prompt, args.tokens, args.repeat, args.threads, weights
                )
            else:
                rates[engine, weights] = run_llama_cpp(
                    gguf(model_dir, args.work, weights), prompt, args.tokens, args.repeat, args.threads
                )
            print(
                json.dumps(
                    {"shape": shape, "engine": engine, "weights": weights, "prefill_decode": rates[engine, weights]}
                ),
                flush=True,
            )
        for (engine, weights), (prefill, decode) in rates.items():
            ours = None if engine == "jaxinfer" else OURS_FOR[weights]
            ratio = (
                None
                if ("jaxinfer", ours) not in rates
                else (rates["jaxinfer", ours][0] / prefill, rates["jaxinfer", ours][1] / decode)
            )
            rows.append((shape, engine, weights, (prefill, decode), ours, ratio))

    lines = [
        "# jaxinfer against its peers",
        "",
        f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads; {versions()}.",
        f"`python scripts/compare_peers.py`: random-weight models, {args.prompt} prompt tokens, {args.tokens} "
        f"new tokens (greedy, EOS ignored), median of {args.repeat} after a warm-up. Each peer row is compared with "
        "the jaxinfer row of the same kind of weights (32-bit with float32, 16-bit with bfloat16; a quantized "
        "llama.cpp row with jaxinfer running the same GGUF file, the KV cache 16-bit on both sides: llama.cpp's "
        "default f16, jaxinfer's `--kv-dtype bfloat16`).",
        "",
        "| model shape | engine | weights | prefill tok/s | decode tok/s | compared with jaxinfer | jaxinfer ÷ peer, "
        "prefill | jaxinfer ÷ peer, decode |",
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for shape, engine, weights, (prefill, decode), ours, ratio in rows:
        ratios = f"{ours} | {ratio[0]:.2f} | {ratio[1]:.2f}" if ratio else "– | – | –"
        lines.append(f"| {shape} | {engine} | {weights} | {prefill:.1f} | {decode:.2f} | {ratios} |")
    table = "\n".join(lines) + "\n"
    rest = args.out.read_text().partition("\n## ")[2] if args.out.is_file() else ""
    args.out.write_text(table + (f"\n## {rest}" if rest else ""))
    print(table)


if __name__ == "__main__":
    main()
