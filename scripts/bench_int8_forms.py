"""Weight-only int8 matmul forms through XLA on this backend, against bfloat16: µs a call (its
dispatch included: compare the largest shape, where it is small), the error against float32, and the
fusion kinds XLA made. It is how we learned that on an H100 no fused XLA form beats bfloat16
(BENCHMARKS.md, "On a GPU"), and it times `jaxinfer.gpu`'s kernel beside them (int8 and int4 in
columns, as `--quantize` holds them on a GPU; on the CPU through Pallas' interpreter: slow).

    python scripts/bench_int8_forms.py
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import forms, gpu

SHAPES = ((2048, 8192), (8192, 2048), (4096, 14336))  # [in, out]: 1B's gate/up, its down, 8B's gate/up


def best_us(f, *args, n: int = 200) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / n)
    return min(times) * 1e6


def fusions(f, *args) -> str:
    entry = f.lower(*args).compile().as_text()
    entry = entry[entry.index("ENTRY") :]
    kinds = " ".join(sorted(set(re.findall(r"kind=(k\w+)", entry))))
    return f"{kinds} | {entry.count(' fusion(')} fusions"


def forms_of(K: int, N: int, B: int) -> dict:
    """name → (jitted function, its arguments, bytes of weights it reads)."""
    key = jax.random.key(0)
    w = jax.random.normal(key, (N, K), jnp.float32) * 0.02
    x = jax.random.normal(key, (B, K), jnp.bfloat16)
    nb = K // 32
    blocks = w.T.reshape(nb, 32, N)
    scale = jnp.abs(blocks).max(1) / 127  # [in/32, out]
    q = jnp.clip(jnp.round(blocks / scale[:, None]), -127, 127).astype(jnp.int8).reshape(K, N)
    scale = scale.astype(jnp.bfloat16)
    channel = (jnp.abs(w).max(1) / 127).astype(jnp.bfloat16)  # per output
    qc = jnp.clip(jnp.round(w.T / channel.astype(jnp.float32)), -127, 127).astype(jnp.int8)
    f32 = dict(preferred_element_type=jnp.float32)
    return {
        "bfloat16 [out, in]": (jax.jit(lambda x, w: jnp.einsum("bi,oi->bo", x, w, **f32)), (x, w.astype(jnp.bfloat16))),
        "bfloat16 [in, out]": (jax.jit(lambda x, w: jnp.dot(x, w, **f32)), (x, w.T.astype(jnp.bfloat16))),
        "int8, ours (packed for the CPU)": (
            jax.jit(lambda x, m: forms.matmul(x, m, False, jnp.float32)),
            (x, forms.Quantized.of(w, "int8")),
        ),
        "int8 [in, out], block scales in the operand": (
            jax.jit(lambda x, q, s: jnp.dot(x, (q.reshape(nb, 32, N) * s[:, None, :]).reshape(K, N), **f32)),
            (x, q, scale),
        ),
        "int8 [in, out], a dot per block, scaled sum": (
            jax.jit(
                lambda x, q, s: (
                    jnp.einsum("bnk,nko->bno", x.reshape(-1, nb, 32), q.reshape(nb, 32, N).astype(x.dtype), **f32)
                    * s.astype(jnp.float32)
                ).sum(1)
            ),
            (x, q, scale),
        ),
        "int8 [in, out], per output, scale after": (
            jax.jit(lambda x, q, s: jnp.dot(x, q.astype(x.dtype), **f32) * s.astype(jnp.float32)),
            (x, qc, channel),
        ),
    } | {
        f"{method} columns, jaxinfer.gpu's kernel": (
            jax.jit(lambda x, m: m.matmul(x, False, jnp.float32)),
            (x, forms.Quantized.of(w, method).in_columns()),
        )
        for method in ("int8", "int4")
        if B <= gpu.ROWS and (gpu.kernel_here() or gpu.MODE == "interpret")
    }, np.asarray(x, np.float32) @ np.asarray(w).T


def main() -> None:
    print(jax.devices()[0].device_kind)
    for K, N in SHAPES:
        for B in (1, 16):
            variants, reference = forms_of(K, N, B)
            for name, (f, args) in variants.items():
                us = best_us(f, *args)
                error = float(np.abs(np.asarray(f(*args), np.float32) - reference).max() / np.abs(reference).max())
                stored = K * N * (2 if name.startswith("bfloat16") else 0.5 if name.startswith("int4") else 1)
                print(
                    f"in {K:5d} out {N:5d} B={B:2d}  {name:44s} {us:8.1f} µs {stored / us / 1e3:6.0f} GB/s "
                    f"rel. error {error:.1e}  {fusions(f, *args)}"
                )


if __name__ == "__main__":
    main()
