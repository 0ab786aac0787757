"""This machine's two roofs, measured on the spot and kept per machine: peak matmul FLOP/s for a
dtype, and memory bandwidth. A datasheet figure given by the user (`--peak-flops`,
`--peak-bandwidth`) replaces the measurement.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer import kernel, packed
from jaxinfer.errors import JaxinferError
from jaxinfer.runtime import default_cache_dir

MATMUL_SIZE = 2048  # N: an N×N @ N×N product, 2N³ FLOPs; large enough to reach the peak on a CPU
COPY_BYTES = 256 * 2**20  # an array this large, read once and written once; far beyond any cache
# An H100 reached 157 TFLOP/s at 2048² and 719 at 8192² (bfloat16), and copied 1.60 TB/s over 256 MiB
# but 2.64 over 4 GiB: probes of the CPU's size read its roofs 2-5× low (MFU 108-157% in `bench`).
ACCELERATOR_SIZES = (8192, 4 * 2**30)


def probe_sizes() -> tuple[int, int]:
    """(N of the matmul, bytes of the copy): large enough to saturate this backend."""
    return (MATMUL_SIZE, COPY_BYTES) if jax.default_backend() == "cpu" else ACCELERATOR_SIZES


REPEATS = 5  # best of: the ceiling is what the machine can do, not what it did on average


@dataclass(frozen=True)
class Ceilings:
    peak_flops: float  # FLOP/s, matmul in `dtype`
    peak_bandwidth: float  # bytes/s, read + written
    dtype: str
    method: str  # how the figures were obtained, for the user to judge them


def _best_seconds(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _kernel_bf16(dtype: str) -> bool:
    """bfloat16 matrices run on our CPU kernel here (`loading.roof_dtype`), at its rate, not XLA's."""
    return dtype == "bfloat16" and kernel.vectorised()


def measure_peak_flops(dtype: str, n: int | None = None) -> float:
    n = n or probe_sizes()[0]
    if _kernel_bf16(dtype):  # its bfloat16 product at its fastest: the inputs rounded, AMX's one pass
        w, x = packed.pack(jnp.ones((n, n), jnp.bfloat16)), jnp.ones((n, n), jnp.float32)
        return 2.0 * n**3 / _best_seconds(jax.jit(lambda x, w: packed.matmul(x, w, bf16_inputs=True)), x, w)
    a = jnp.ones((n, n), dtype)
    return 2.0 * n**3 / _best_seconds(jax.jit(lambda x, y: x @ y), a, a)


def measure_bandwidth(nbytes: int | None = None) -> tuple[float, float, float]:
    """(copy, sum, matvec) bytes/s: a copy counts bytes read + written; a sum and a matrix-vector
    product (decode's own read: every weight once) read only. On XLA CPU the copy runs far below
    the reads (12 vs 64 GB/s measured on our 2-core machine) and the matvec above the sum (40 vs
    33 GB/s), so the highest of the three is the roof: the fastest reader sets it."""
    nbytes = nbytes or probe_sizes()[1]
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = 2.0 * nbytes / _best_seconds(jax.jit(lambda v: v + 1.0), x)
    read = nbytes / _best_seconds(jax.jit(jnp.sum), x)
    side = int((nbytes // 4) ** 0.5)
    matrix, vector = x[: side * side].reshape(side, side), jnp.ones((side,), jnp.float32)
    matvec = 4.0 * side * side / _best_seconds(jax.jit(lambda a, b: a @ b), matrix, vector)
    return copy, read, matvec


def machine_key() -> str:
    """The roofs are one device's: the same whatever the `devices` (on the CPU, the count of its devices) is."""
    device = jax.devices()[0]
    return f"{device.platform}:{device.device_kind}:{platform.node()}:{os.cpu_count()}"


def _store() -> Path:
    return default_cache_dir().parent / "ceilings.json"


def check_peaks(peak_flops: float | None, peak_bandwidth: float | None) -> None:
    """Given peaks are positive, finite numbers (MFU and MBU divide by them)."""
    for name, value in (("peak_flops", peak_flops), ("peak_bandwidth", peak_bandwidth)):
        if value is not None and not (0 < value < math.inf):
            raise JaxinferError(f"{name} must be a positive number, not {value}", name)


def machine_ceilings(
    dtype: str,
    peak_flops: float | None = None,
    peak_bandwidth: float | None = None,
    announce=None,
    remeasure: bool = False,
) -> Ceilings:
    """The roofs for `dtype` on this machine: overrides where given, else the stored measurement,
    else measured now (about two seconds; `announce()` is called first) and stored. `remeasure`
    probes again and keeps, per roof, the best of every probe so far: a probe on a busy machine
    reads low, and a roof is what the machine can do."""
    check_peaks(peak_flops, peak_bandwidth)
    try:
        store: Path | None = _store()
    except OSError:
        store = None  # no home at all: measured each time, never stored
    try:
        known = json.loads(store.read_text()) if store else {}
    except (OSError, ValueError):
        known = {}
    # measured on the kernel: each JAXINFER_ISA path has its own roof
    isa = kernel.isa() if _kernel_bf16(dtype) else None
    key = f"{machine_key()}:{dtype}" + (f":kernel {isa}, bfloat16 inputs" if isa else "")
    if jax.default_backend() != "cpu":  # measured again where the probes were the CPU's, too small here
        key += f":{probe_sizes()[0]}²"
    if remeasure or (key not in known and (peak_flops is None or peak_bandwidth is None)):
        if announce:
            announce()
        copy, read, matvec = measure_bandwidth()
        n, nbytes = probe_sizes()
        earlier = known.get(key, {})
        probes = earlier.get("probes", 1 if earlier else 0) + 1
        known[key] = asdict(
            Ceilings(
                max(measure_peak_flops(dtype), earlier.get("peak_flops", 0.0)),
                max(copy, read, matvec, earlier.get("peak_bandwidth", 0.0)),
                dtype,
                f"measured {time.strftime('%Y-%m-%d')}{f', the best of {probes} probes' if probes > 1 else ''}: best "
                f"of {REPEATS} jitted "
                f"{n}² {dtype} matmuls{f' on the kernel ({isa}, bfloat16 inputs)' if isa else ''} (2N³ "
                f"FLOPs); bandwidth the highest of a {nbytes // 2**20} MiB copy "
                f"({copy / 1e9:.1f} GB/s, read + written), sum ({read / 1e9:.1f} GB/s) and matrix-vector product "
                f"({matvec / 1e9:.1f} GB/s, read), best of {REPEATS}",
            )
        ) | {"probes": probes}
        try:
            if store:
                store.parent.mkdir(parents=True, exist_ok=True)
                store.write_text(json.dumps(known, indent=1) + "\n")
        except OSError:
            pass  # a read-only home: measure again next time
    stored = known.get(key, {})
    method = stored.get("method", "")
    given = [name for name, value in (("peak FLOP/s", peak_flops), ("bandwidth", peak_bandwidth)) if value is not None]
    if given:
        method = " and ".join(given) + " given by the user" + (f"; otherwise {method}" if len(given) < 2 else "")
    return Ceilings(
        peak_flops if peak_flops is not None else stored["peak_flops"],
        peak_bandwidth if peak_bandwidth is not None else stored["peak_bandwidth"],
        dtype,
        method,
    )


def device_memory_bytes(free: bool = False) -> int:
    """Memory the model and cache can use: the accelerator's own (`free`: less what is in use),
    or on the CPU the RAM available now."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - (int(stats.get("bytes_in_use", 0)) if free else 0)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
