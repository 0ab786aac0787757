"""Where a decode step's time goes, on whatever backend JAX runs: the decode loop timed in chunks
(ITL), then one chunk traced by `jax.profiler` and its device kernels summed by name, with the
device's busy time against the chunk's span (the rest is idle: launches, host syncs, the loop's
own bookkeeping). The trace (`--trace DIR`) opens in Perfetto.

    python scripts/profile_decode.py MODEL_DIR [--dtype bfloat16] [--quantize int8] [-b 1] [-p 520] [--layout out_in]

`JAXINFER_GPU_KERNELS=off` runs decode's attention (and int8/int4 products) on XLA instead of the
GPU's kernels; `--layout out_in` keeps q/k/v and gate/up apart (a GPU's default, "fused", stacks them).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer.loading import open_model
from jaxinfer.roofline import Storage, decode_step_cost
from jaxinfer.runtime import CompileReport
from jaxinfer.sampling import Sampling
from jaxinfer.slots import Admission, Slots


def kernels(trace_dir: Path) -> tuple[collections.Counter, collections.Counter, float, float]:
    """Per kernel name: total µs and count, over the device's streams of the Perfetto trace; and
    the device's busy µs and the span from its first kernel to its last."""
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.loads(gzip.open(path).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name.upper()}
    busy, count, spans = collections.Counter(), collections.Counter(), []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            busy[e["name"]] += e["dur"]
            count[e["name"]] += 1
            spans.append((e["ts"], e["ts"] + e["dur"]))
    if not spans:
        return busy, count, 0.0, 0.0
    spans.sort()
    merged, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            merged, lo, hi = merged + hi - lo, a, b
        else:
            hi = max(hi, b)
    merged += hi - lo
    return busy, count, merged, spans[-1][1] - spans[0][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize")
    ap.add_argument("--kv-dtype")
    ap.add_argument("--layout", help="the weights' layout (forms.LAYOUTS; default: the backend's)")
    ap.add_argument("-b", "--batch", type=int, default=1)
    # 520 + 7 chunks of 64 stay in one kv bucket (1024): no chunk pays a new bucket's compile
    ap.add_argument("-p", "--prompt", type=int, default=520)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timed chunk")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--trace", help="keep the trace here (default: a temporary folder)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    opened = open_model(a.model, dtype=a.dtype, quantize=a.quantize, kv_dtype=a.kv_dtype, layout=a.layout)
    cfg, params = opened.model.config, opened.model.params
    S = a.prompt + a.steps * (a.chunks + 2) + 1
    slots = Slots(cfg, params, a.batch, S, eos_ids=())
    prompts = np.random.default_rng(0).integers(100, cfg.vocab_size, (a.batch, a.prompt)).tolist()
    report = CompileReport()
    slots.admit([Admission(r, prompts[r], S - a.prompt, r, Sampling()) for r in range(a.batch)], report)
    slots.step(a.steps, report)
    jax.block_until_ready(slots.state)  # compiled and warm
    itl = []
    for _ in range(a.chunks):
        start = time.perf_counter()
        slots.step(a.steps, report)
        jax.block_until_ready(slots.state)
        itl.append((time.perf_counter() - start) / a.steps)
    trace = Path(a.trace or tempfile.mkdtemp())
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        slots.step(a.steps, report)
        jax.block_until_ready(slots.state)
    busy, count, merged, span = kernels(trace)
    moved = decode_step_cost(cfg, Storage.of_params(params), kv_len=a.prompt + a.steps, batch=a.batch).bytes
    ms = statistics.median(itl) * 1e3
    print(
        f"{jax.devices()[0].device_kind}: {a.model} {a.dtype} {a.quantize or ''} B={a.batch}: ITL {ms:.3f} ms "
        f"(chunks {', '.join(f'{1e3 * t:.3f}' for t in itl)}), {moved / 1e9:.2f} GB a step: "
        f"{moved / ms / 1e6:.0f} GB/s; compile {report.seconds:.1f} s"
    )
    if span:
        per = a.steps
        print(
            f"traced chunk: device busy {merged / per:.0f} µs/step of a {span / per:.0f} µs/step span; "
            f"{sum(count.values()) / per:.0f} kernels/step"
        )
        print(f"{'µs/step':>9} {'n/step':>7}  kernel")
        for name, us in busy.most_common(a.top):
            print(f"{us / per:9.1f} {count[name] / per:7.1f}  {name[:110]}")
    print(json.dumps({"itl_ms": ms, "busy_us": merged / a.steps if span else None, "step_bytes": moved}))


if __name__ == "__main__":
    main()
