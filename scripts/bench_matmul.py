"""The CPU float kernel (`jaxinfer.packed`) against XLA's dot, one matrix at a time: ms per call and
the weights' GB/s, for the row counts each phase runs (1: decode; 2–16: batched decode and
speculation's verify pass; 128: a prefill chunk), float32 and bfloat16 weights; bfloat16 also with
the inputs rounded to bfloat16 (`--dtype bfloat16`: AMX's one pass) and, on a CPU with AMX, with AMX
switched off (the kernel takes it from 16 rows).

    python scripts/bench_matmul.py                      # SmolLM-135M's and TinyLlama's matrices
    python scripts/bench_matmul.py --rows 1,5 --repeat 50
    python scripts/bench_matmul.py --rows 16 --cold 30  # float32 weights cold, as decode reads them

`--cold N` cycles N copies of each SmolLM-135M matrix through the kernel inside one jitted loop, so
every call's weights come from memory (as a decode step's, 30 layers apart) and no call pays a
dispatch: the kernel's GFLOP/s, best of 40 loops. `taskset -c 1` in front measures one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import kernel, packed

MATRICES = {  # name: (out, in)
    "smollm up 1536×576": (1536, 576),
    "smollm down 576×1536": (576, 1536),
    "smollm head 49152×576": (49152, 576),
    "tinyllama up 5632×2048": (5632, 2048),
    "tinyllama down 2048×5632": (2048, 5632),
}


def ms(fn, *args, repeat: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def without_amx(fn):
    """fn, on the kernel's AVX-512 paths only."""

    def run(*args):
        with kernel.capped("avx512"):
            return jax.block_until_ready(fn(*args))

    return run


def torch_linear():
    """x @ w.T by PyTorch in bfloat16, on all cores as XLA's pool (activations rounded to bfloat16,
    as transformers' bfloat16 models compute); the arrays are converted once and kept."""
    import torch

    converted = {}

    def run(x, w):
        key = (id(x), id(w))
        if key not in converted:
            converted.clear()
            converted[key] = (torch.from_numpy(np.array(x)).bfloat16(), torch.from_numpy(np.array(w)).bfloat16())
        with torch.no_grad():
            return torch.nn.functional.linear(*converted[key])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,5,9,16,128,512")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--torch", action="store_true", help="also PyTorch's bfloat16 linear (oneDNN), as transformers runs it"
    )
    parser.add_argument("--cold", type=int, default=0, help="copies of each matrix cycled (float32, the kernel only)")
    args = parser.parse_args()
    if not kernel.available():
        raise SystemExit("the kernels were not built for this machine (or the backend is not the CPU)")
    if args.cold:
        return cold(args.cold, [int(r) for r in args.rows.split(",")])
    print(f"kernel path: {kernel.isa()}; ms per call (weights' GB/s), median of {args.repeat}")
    xla = jax.jit(lambda x, w: jnp.einsum("mi,oi->mo", x, w, preferred_element_type=jnp.float32))
    xla_io = jax.jit(lambda x, w: jnp.einsum("mi,io->mo", x, w, preferred_element_type=jnp.float32))
    ours = jax.jit(packed.matmul)
    rounded = jax.jit(lambda x, w: packed.matmul(x, w, bf16_inputs=True))
    rng = np.random.default_rng(0)
    for name, (n, k) in MATRICES.items():
        w32 = jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.05)
        print(f"{name}")
        for dtype in (jnp.float32, jnp.bfloat16):
            w = w32.astype(dtype)
            forms = {
                "XLA [out,in]": (xla, w),
                "XLA [in,out]": (xla_io, jnp.asarray(w.T)),
                "kernel": (ours, packed.pack(w)),
            }
            if dtype == jnp.bfloat16:
                forms["kernel, bf16 inputs"] = (rounded, packed.pack(w))
            if dtype == jnp.bfloat16 and kernel.isa().endswith("amx"):  # from 16 rows the kernel takes AMX
                forms["kernel, no AMX"] = (without_amx(ours), packed.pack(w))
            if dtype == jnp.bfloat16 and args.torch:
                forms["torch"] = (torch_linear(), np.asarray(w.astype(jnp.float32)))
            gb = n * k * jnp.dtype(dtype).itemsize / 1e9
            for rows in (int(r) for r in args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
                cells = []
                for form, (fn, weight) in forms.items():
                    t = ms(fn, x, weight, repeat=args.repeat)
                    cells.append(f"{form} {t:8.3f} ({gb / t * 1e3:5.1f})")
                print(f"  {jnp.dtype(dtype).name:8} M={rows:<4} " + "  ".join(cells), flush=True)


def cold(copies: int, rows: list[int], loops: int = 4) -> None:
    """The kernel's GFLOP/s on SmolLM-135M's matrices with `copies` of each cycled in one jitted loop."""
    rng = np.random.default_rng(0)
    print(f"kernel path: {kernel.isa()}; GFLOP/s over {copies} copies of each matrix, best of 40")
    for name, (n, k) in MATRICES.items():
        if not name.startswith("smollm") or "head" in name:
            continue
        weights = [packed.pack(jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.05)) for _ in range(copies)]
        cells = []
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32))

            @jax.jit
            def chain(x, weights):
                def body(_, acc):  # each product's input depends on the one before: no call is skipped
                    for w in weights:
                        acc = acc + packed.matmul(acc, w)[:, :1].sum() * 0
                    return acc

                return jax.lax.fori_loop(0, loops, body, x)

            jax.block_until_ready(chain(x, weights))
            best = float("inf")
            for _ in range(40):
                start = time.perf_counter()
                jax.block_until_ready(chain(x, weights))
                best = min(best, (time.perf_counter() - start) / loops / copies)
            cells.append(f"M={m} {2 * m * n * k / best / 1e9:6.1f}")
        print(f"  {name:24} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
