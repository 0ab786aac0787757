"""The GPU kernels' tiles tried on the device, so that their defaults are measured, not guessed
(`gpu.Tiles`, `gpu_attention.Tiles`). Every row is printed as it comes and kept in `--out`/sweep.jsonl.

    python scripts/sweep_gpu_kernels.py --parts roof,gemv,attention [--budget 300] [--out DIR]
    python scripts/sweep_gpu_kernels.py --parts decode --model DIR [--int8 'step=4,bn=256'] [--int4 ..]
        [--attention 'splits=1' | xla] [profile_decode.py's flags]

- roof: what a decode step can read at best: a read-only sum over 4 GiB, the copy (`x * 2`), and
  XLA's bfloat16 product of one row by each 8B matrix (the bfloat16 step's own form).
- gemv: the int8/int4 product on the Llama-3.1-8B shapes' matrices (q/k/v, o, gate/up, down, the
  LM head; columns as the GPU holds them), each matrix in enough copies (≥ 512 MB) that L2 never holds
  one, as a decode step reads it: first every configuration on gate/up, then the best few on all five.
  Each configuration's answer is checked against XLA's product of the dequantized matrix.
- attention: decode's attention over 1B- and 8B-shaped caches (bucket 1024; positions 520 and 968),
  µs a layer against the bytes its keys and values hold: the tiles, a null kernel of the same grid
  (the floor of a launch), XLA's einsums (`JAXINFER_GPU_KERNELS=off`'s path) and JAX's own
  `decode_attention.gqa`.
- decode: `profile_decode.py` on a model with the given tiles as defaults (end to end: ITL, kernels).

`--budget` seconds a part: a part stops trying configurations when its time is spent (a GPU lease
is short), and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import gpu, gpu_attention, model

SHAPES = {  # Llama-3.1-8B's matrices as the GPU's fused layout holds them: inputs, outputs
    "gate_up": (4096, 28672),
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
COPIES_BYTES = 512e6  # each shape's copies: more than L2 (50-60 MB) many times over
BIG = 1 << 31  # the roof's array: 4 GiB of bfloat16
CACHES = {"1b": (16, 64), "8b": (32, 128)}  # layers, head dim (8 kv heads of 4 queries each)
BUCKET, POSITIONS = 1024, (968, 520)  # decode at 520 + 7 chunks of 64 (profile_decode's) stays in one bucket
ROWS: list[dict] = []
BITS, ONLY = (8, 4), ""  # gemv's widths, and a filter on its configurations' labels
OUT: Path | None = None


def emit(**row) -> None:
    ROWS.append(row)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if OUT:
        with open(OUT / "sweep.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def timed(fn, *args, n: int = 10) -> float:
    """Seconds a call, warm (two calls first: the compile and one more)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n


def tiles_of(text: str, cls):
    """'step=4,bn=256,pad=false' → cls(step=4, bn=256, pad=False)."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, "" if text == "default" else text.split(",")):
        key, value = item.split("=")
        values[key] = (
            None
            if value == "none"
            else value.lower() == "true"
            if value.lower() in ("true", "false")
            else int(value)
            if value.isdigit()
            else value
        )
        assert key in fields, key
    return cls(**values)


def label(tiles) -> str:
    default = type(tiles)()
    return (
        ",".join(
            f"{f.name}={getattr(tiles, f.name)}"
            for f in dataclasses.fields(tiles)
            if getattr(tiles, f.name) != getattr(default, f.name)
        )
        or "default"
    )


# ------------------------------------------------------------------------------------ roof
def roof() -> float:
    big = jnp.ones((BIG,), jnp.bfloat16)
    t = timed(jax.jit(lambda a: a.sum(dtype=jnp.float32)), big)
    read = big.nbytes / t / 1e9
    emit(part="roof", what="read (sum over 4 GiB)", GBps=read)
    t = timed(jax.jit(lambda a: a * 2), big)
    emit(part="roof", what="copy (x * 2, 4 GiB)", GBps=2 * big.nbytes / t / 1e9)
    del big
    for shape, (K, N) in SHAPES.items():
        copies = max(1, math.ceil(COPIES_BYTES / (K * N * 2)))
        ws = [jax.random.normal(jax.random.key(c), (K, N), jnp.bfloat16) for c in range(copies)]
        x = jnp.ones((1, K), jnp.bfloat16)
        f = jax.jit(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws])
        us = timed(f, x, ws) / copies * 1e6
        emit(part="roof", what=f"bf16 x@W {shape}", shape=shape, us=us, GBps=K * N * 2 / us / 1e3)
        del ws
    return read


# ------------------------------------------------------------------------------------ gemv
def matrices(K: int, N: int, bits: int) -> list[tuple[jax.Array, jax.Array]]:
    size = K * N * bits // 8 + K // 32 * N * 2
    out = []
    for c in range(max(1, math.ceil(COPIES_BYTES / size))):
        k1, k2 = jax.random.split(jax.random.key(c))
        q = (
            jax.random.randint(k1, (K, N), -127, 128).astype(jnp.int8)
            if bits == 8
            else jax.random.randint(k1, (K // 2, N), 0, 256).astype(jnp.uint8)
        )
        out.append((q, jax.random.uniform(k2, (K // 32, N), minval=0.001, maxval=0.01).astype(jnp.bfloat16)))
    return out


def gemv_one(shape: str, bits: int, tiles: gpu.Tiles, mats, reference, m: int = 1, read: float = 0.0) -> dict | None:
    K, N = SHAPES[shape]
    x = jax.random.normal(jax.random.key(7), (m, K)).astype(jnp.bfloat16)
    f = jax.jit(lambda x, mats: [gpu._quantized_matmul(x, q, s, bits, gpu.MODE == "interpret", tiles) for q, s in mats])
    try:
        got = np.asarray(f(x, mats[:1])[0])
        us = timed(f, x, mats) / len(mats) * 1e6
    except Exception as e:  # a configuration Triton does not take: its row says so
        emit(part="gemv", shape=shape, bits=bits, m=m, tiles=label(tiles), error=str(e).splitlines()[0][:160])
        return None
    expected = np.asarray(x, np.float32) @ reference
    err = float(np.abs(got - expected).max() / np.abs(expected).max())
    size = K * N * bits / 8 + K / 32 * N * 2
    row = dict(part="gemv", shape=shape, bits=bits, m=m, tiles=label(tiles), us=us, GBps=size / us / 1e3, err=err)
    if read:
        row["roof_pct"] = 100 * size / us / 1e3 / read
    emit(**row)
    return row if err < 1e-3 else None


def gemv_configs(bits: int) -> list[gpu.Tiles]:
    """The likeliest first (a part's budget may end the list): on an H100 (2026-11-28) the CUDA
    cores' kind led for int8, and fatter iterations on the tensor cores lost (BENCHMARKS.md)."""
    T = gpu.Tiles
    unpack = "magic" if bits == 4 else "i32"
    configs = [T(), gpu.TILES[bits]]
    for step in (1, 2, 4):
        for bn in (256, 512):
            for warps in (2, 4):
                configs.append(T(kind="fma", step=step, bn=bn, warps=warps, stages=1, unpack=unpack))
    if bits == 4:
        configs += [T(unpack=u) for u in ("i8", "magic")] + [T(kind="fma", step=2, bn=256, stages=1, unpack="i8")]
    configs += [T(kind="fma", step=2, bn=256, stages=s, unpack=unpack) for s in (2, 3)]
    configs += [T(kind="fma", step=2, bn=256, stages=1, programs=p, unpack=unpack) for p in (132, 528, 1056)]
    configs += [T(kind="fma", step=2, bn=256, stages=1, evict=True, unpack=unpack)]
    configs += [T(pad=False), T(evict=True), T(programs=528), T(warps=8), T(step=2), T(step=4, warps=8)]
    return list(dict.fromkeys(configs))


def gemv(budget: float, read: float) -> None:
    method = {8: "int8", 4: "int4"}
    best: dict[int, list[tuple[float, gpu.Tiles]]] = {8: [], 4: []}
    for bits in BITS:
        start = time.perf_counter()
        K, N = SHAPES["gate_up"]
        mats = matrices(K, N, bits)
        reference = np.asarray(gpu.columns_dense(mats[0], method[bits]))
        results = []
        for tiles in [t for t in gemv_configs(bits) if t == gpu.Tiles() or ONLY in label(t)]:
            if time.perf_counter() - start > budget / 3:
                emit(part="gemv", note=f"int{bits} gate_up: budget spent, configurations left untried")
                break
            row = gemv_one("gate_up", bits, tiles, mats, reference, read=read)
            if row:
                results.append((row["us"], tiles))
        best[bits] = sorted(results, key=lambda r: r[0])[:4]
        for m in (4, 16):  # decode's batches: the best dot kind
            dots = [t for _, t in best[bits] if t.kind == "dot"]
            if dots:
                gemv_one("gate_up", bits, dots[0], mats, reference, m=m, read=read)
        del mats, reference
    start = time.perf_counter()
    for shape in ("qkv", "o", "down", "lm_head"):
        for bits in BITS:
            K, N = SHAPES[shape]
            mats = matrices(K, N, bits)
            reference = np.asarray(gpu.columns_dense(mats[0], method[bits]))
            for tiles in [gpu.Tiles()] + [t for _, t in best[bits] if t != gpu.Tiles()]:
                if time.perf_counter() - start > budget / 3:
                    emit(part="gemv", note="all shapes: budget spent")
                    return
                gemv_one(shape, bits, tiles, mats, reference, read=read)
            del mats, reference


# ------------------------------------------------------------------------------------ attention
def attention(budget: float, read: float) -> None:
    start = time.perf_counter()
    found: list = []
    for name, (L, hd) in CACHES.items():
        S, KV, G = BUCKET, 8, 4
        k = jax.random.normal(jax.random.key(1), (L, 1, S, KV, hd)).astype(jnp.bfloat16)
        v = jax.random.normal(jax.random.key(2), (L, 1, S, KV, hd)).astype(jnp.bfloat16)
        q = jax.random.normal(jax.random.key(3), (L, 1, 1, KV, G, hd)).astype(jnp.bfloat16)
        for position in POSITIONS:
            pos = jnp.full((1, 1), position, jnp.int32)
            size = (position + 1) * KV * hd * 2 * 2
            reference = None

            def run(what, f, tiles=None):
                nonlocal reference
                try:
                    out = f(q, k, v, pos)
                    us = timed(f, q, k, v, pos) / L * 1e6
                except Exception as e:
                    emit(part="attention", model=name, position=position, what=what, error=str(e).splitlines()[0][:160])
                    return None
                got = np.asarray(out[0], np.float32).reshape(-1)
                if reference is None:
                    reference = got
                err = float(np.abs(got - reference).max() / np.abs(reference).max())
                row = dict(
                    part="attention",
                    model=name,
                    position=position,
                    what=what,
                    us_layer=us,
                    GBps=size / us / 1e3,
                    err=err,
                )
                if tiles is not None:
                    row["tiles"] = label(tiles)
                emit(**row)
                return us

            def ours(tiles):
                return jax.jit(
                    lambda q, k, v, pos: [
                        gpu_attention.attend(q[i], pos, k, v, None, None, i, None, S, None, hd**-0.5, None, tiles=tiles)
                        for i in range(L)
                    ]
                )

            xla = jax.jit(
                lambda q, k, v, pos: [_xla_attention(q[i][:, 0], pos, k[i], v[i], hd**-0.5) for i in range(L)]
            )
            run("xla einsums", xla)
            T = gpu_attention.Tiles
            if position == POSITIONS[0]:  # every cut of the keys, then Triton's knobs on the best
                configs = [T()] + [T(block=b, splits=s) for b in (64, 128, 256) for s in (1, 2, 4, 8, 16)]
            else:
                configs = [T()] + [t for _, t in sorted(found)[:3]]
            found = found if position != POSITIONS[0] else []
            for tiles in configs:
                if time.perf_counter() - start > budget:
                    emit(part="attention", note="budget spent")
                    return
                us = run("kernel", ours(tiles), tiles)
                if us is not None and position == POSITIONS[0]:
                    found.append((us, tiles))
            if position == POSITIONS[0] and found:
                best = min(found)[1]
                for warps, stages in ((2, 1), (2, 2), (2, 3), (4, 1), (4, 3), (8, 1), (8, 2), (8, 3)):
                    tiles = dataclasses.replace(best, warps=warps, stages=stages)
                    us = run("kernel", ours(tiles), tiles)
                    if us is not None:
                        found.append((us, tiles))
            # the floor: the same operands and grid, a kernel that stores zeros
            if position != POSITIONS[0]:
                continue
            real = gpu_attention._program
            gpu_attention._program = _null_program
            gpu_attention._attend.clear_cache()
            try:
                for s in (1, 16):
                    run("null kernel", ours(T(splits=s)), T(splits=s))
            finally:
                gpu_attention._program = real
                gpu_attention._attend.clear_cache()
            try:
                from jax.experimental.pallas.ops.gpu import decode_attention
            except ImportError as e:
                emit(part="attention", note=f"no decode_attention: {e}")
                continue
            per_layer = [(k[i], v[i]) for i in range(L)]  # [1, S, KV, hd] each: arrays of their own
            for splits in (1, 4, 16):
                g = jax.jit(
                    lambda q, kv, pos, splits=splits: [
                        decode_attention.gqa(
                            q[i][:, 0].reshape(1, KV * G, hd),
                            a,
                            b,
                            kv_seq_len=pos[:, 0] + 1,
                            sm_scale=hd**-0.5,
                            k_splits=splits,
                            interpret=gpu.MODE == "interpret",
                        )
                        for i, (a, b) in enumerate(kv)
                    ]
                )
                run(f"jax decode_attention.gqa k_splits={splits}", lambda q, k, v, pos, g=g: g(q, per_layer, pos))


def _xla_attention(q, pos, k, v, scale):
    """XLA's decode attention, as `model._attend` then the normalisation: q [B, KV, G, hd]."""
    top, total, out = model._attend(q, pos, None, scale, None, k, v, None, None, 0)
    return out / total[..., None]


def _null_program(rows_ref, layer_ref, positions_ref, q_ref, k_ref, v_ref, *refs, **_):
    from jax.experimental.pallas import triton as plgpu

    out_ref, top_ref, total_ref = refs[-3:]
    rows = q_ref.shape[0]
    plgpu.store(out_ref, jnp.zeros(out_ref.shape, jnp.float32))
    plgpu.store(top_ref, jnp.zeros((rows,), jnp.float32))
    plgpu.store(total_ref, jnp.ones((rows,), jnp.float32))


def best(path: Path) -> str:
    """The fastest tiles a sweep found, as `--parts decode`'s flags: int8's and int4's by their
    time summed over the shapes they all ran on (gate/up alone if the sweep ended there), attention's
    summed over the caches at the first position."""
    rows = [json.loads(line) for line in open(path)]
    flags = []
    for bits in (8, 4):
        ok = [
            r
            for r in rows
            if r.get("part") == "gemv" and r.get("bits") == bits and r.get("m") == 1 and "us" in r and r["err"] < 1e-3
        ]
        shapes = {r["shape"] for r in ok}
        by = {}
        for r in ok:
            by.setdefault(r["tiles"], {})[r["shape"]] = r["us"]
        complete = {t: sum(v.values()) for t, v in by.items() if set(v) == shapes}
        choice = min(complete, key=complete.get) if complete else min(by, key=lambda t: by[t].get("gate_up", 1e9))
        flags += [f"--int{bits}", choice]
    ok = [
        r
        for r in rows
        if r.get("part") == "attention"
        and r.get("what") == "kernel"
        and "us_layer" in r
        and r["err"] < 2e-2
        and r["position"] == POSITIONS[0]
    ]
    by = {}
    for r in ok:
        by.setdefault(r["tiles"], {})[r["model"]] = r["us_layer"]
    models = {r["model"] for r in ok}
    complete = {t: sum(v.values()) for t, v in by.items() if set(v) == models}
    flags += ["--attention", min(complete, key=complete.get) if complete else "default"]
    return " ".join(flags)


# ------------------------------------------------------------------------------------ decode
def decode(model_dir: str, int8: str, int4: str, attention_tiles: str, extra: list[str]) -> None:
    """profile_decode.py in this process, the given tiles the defaults."""
    gpu.TILES = {8: tiles_of(int8, gpu.Tiles), 4: tiles_of(int4, gpu.Tiles)}
    if attention_tiles == "xla":  # attention by XLA's einsums (the int8/int4 products still by the kernel)
        gpu_attention.here = lambda *_: False
    else:
        gpu_attention.TILES = tiles_of(attention_tiles, gpu_attention.Tiles)
    sys.path.insert(0, str(Path(__file__).parent))
    import profile_decode

    sys.argv = ["profile_decode.py", model_dir, *extra]
    print(
        f"== decode with int8 {label(gpu.TILES[8])}, int4 {label(gpu.TILES[4])}, "
        f"attention {attention_tiles or 'default'}",
        flush=True,
    )
    profile_decode.main()


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="roof,gemv,attention")
    ap.add_argument("--budget", type=float, default=240, help="seconds a part at most")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", help="decode: the model directory")
    ap.add_argument("--int8", default="", help="decode: int8's gpu.Tiles fields, 'step=4,bn=256'")
    ap.add_argument("--int4", default="", help="decode: int4's gpu.Tiles fields")
    ap.add_argument("--attention", default="", help="decode: gpu_attention.Tiles fields, 'splits=1'")
    ap.add_argument("--bits", default="8,4", help="gemv: the codes' widths")
    ap.add_argument("--only", default="", help="gemv: the configurations whose label holds this (and the default)")
    ap.add_argument("--dry", action="store_true", help="the script itself checked: small shapes, Pallas' interpreter")
    a, extra = ap.parse_known_args()
    OUT = a.out
    global BITS, ONLY
    BITS, ONLY = tuple(int(b) for b in a.bits.split(",")), a.only
    if a.dry:
        global COPIES_BYTES, SHAPES, BIG
        gpu.MODE, COPIES_BYTES, BIG = "interpret", 1e5, 1 << 20
        SHAPES = {name: (K // 32, N // 64) for name, (K, N) in SHAPES.items()}
        global CACHES, BUCKET, POSITIONS
        CACHES, BUCKET, POSITIONS = {"1b": (2, 64), "8b": (2, 128)}, 256, (200,)
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
    parts = a.parts.split(",")
    if parts == ["best"]:
        print(best(OUT / "sweep.jsonl"))
        return
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    read = roof() if "roof" in parts else 0.0
    if "gemv" in parts:
        gemv(a.budget, read)
    if "attention" in parts:
        attention(a.budget, read)
    if "decode" in parts:
        decode(a.model, a.int8, a.int4, a.attention, extra)


if __name__ == "__main__":
    main()
