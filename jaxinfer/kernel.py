"""The compiled CPU kernels (`kernels/`, built by `pip install`): found, registered with XLA, capped to
a path (JAXINFER_ISA, the tests' `isa` fixture), and switched off by tests to compare them with XLA's
own path.

Where they were not built (no C++ compiler) or the backend is not the CPU, `available()` is False
and every matrix takes XLA's dot. The library also holds constrained decoding's step
(`jaxinfer.matchers` binds it to llguidance), which the GPU reaches through a Python callback.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import JaxinferError

TARGETS = (
    "jaxinfer_qmatmul",
    "jaxinfer_kmatmul",
    "jaxinfer_fmatmul",
    "jaxinfer_qmatmul_routed",
    "jaxinfer_kmatmul_routed",
    "jaxinfer_fmatmul_routed",
    "jaxinfer_attention",
    "jaxinfer_constrain_advance",
    "jaxinfer_constrain_check",
)


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_kernels{suffix}"
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, registered with XLA for the CPU; None where they were not built."""
    path = _library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for target in TARGETS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    lib.jaxinfer_kernel_isa.restype = ctypes.c_char_p
    lib.jaxinfer_cap_isa(_own_cap())
    return lib


# The kernels' caps by name → the level `jaxinfer_cap_isa` takes, best first: the CPU's best paths;
# its best family without matrix units (x86: AVX-512 without AMX); the base vector family with its
# dot product (x86: AVX2 with AVX-VNNI, as Alder Lake has it; ARM: NEON with SDOT, which is native);
# the base vector family alone (x86: AVX2 + FMA, as Zen 1-3; ARM: NEON without SDOT); the portable
# C++. A cap only lowers: a CPU without AVX-512 takes AVX2 under "avx512". Each machine names only
# the caps its architecture has.
_MACHINE = platform.machine().lower()
if _MACHINE in ("x86_64", "amd64"):
    ISA_CAPS = {"native": 0, "avx512": 1, "avx2-vnni": 2, "avx2": 3, "generic": 4}
elif _MACHINE in ("aarch64", "arm64"):
    ISA_CAPS = {"native": 0, "neon": 3, "generic": 4}
else:
    ISA_CAPS = {"native": 0, "generic": 4}


def _own_cap() -> int:
    """The process's cap level: JAXINFER_ISA (one of ISA_CAPS, read at load), so any path can be run
    and measured on a CPU that has a better one, or a misbehaving one turned off."""
    asked = os.environ.get("JAXINFER_ISA", "native") or "native"
    if asked not in ISA_CAPS:
        raise JaxinferError(f"JAXINFER_ISA must be one of {', '.join(ISA_CAPS)}, not {asked!r}")
    return ISA_CAPS[asked]


@contextlib.contextmanager
def capped(path: str):
    """The kernels on `path` (one of ISA_CAPS) inside the block, or the process's own cap where that
    is lower; then back to the process's cap."""
    lib = library()
    lib.jaxinfer_cap_isa(max(ISA_CAPS[path], _own_cap()))
    try:
        yield
    finally:
        lib.jaxinfer_cap_isa(_own_cap())


enabled = True  # tests turn it off to compare with XLA's path


def available() -> bool:
    return enabled and jax.default_backend() == "cpu" and library() is not None


def vectorised() -> bool:
    """Available, and on a vectorised path (AVX2, AVX-512, NEON): the portable C++ path rereads the
    weights for every row, fine as a fallback for quantized matrices but slower than XLA's dot for
    float ones."""
    return available() and isa() != "generic"


def isa() -> str | None:
    """The paths the kernels take on this CPU under the cap, where they are built: the family
    ('avx512', 'avx2', 'neon' or 'generic') and what it adds ('-vnni', '-bf16', '-amx', '-dotprod'),
    as 'avx512-vnni-bf16-amx'; else None."""
    lib = library()
    return lib.jaxinfer_kernel_isa().decode() if lib else None


def call(
    target: str, x: jax.Array, out: int, *weights: jax.Array, experts: jax.Array | None = None, **attributes
) -> jax.Array:
    """x [..., K] through `target` → float32 [..., out]; with `experts` (an expert id per row of x),
    through its `_routed` twin: each row by its own matrix of the weights' stacks [E, ...]."""
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    operands = (flat, *weights) if experts is None else (flat, *weights, experts.reshape(-1).astype(jnp.int32))
    target = target if experts is None else f"{target}_routed"
    y = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((flat.shape[0], out), jnp.float32))(*operands, **attributes)
    return y.reshape(*x.shape[:-1], out)


ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 128, 256, 512)  # the kernel's vectorised paths (512: Gemma 4's)


def attention(
    q: jax.Array,
    positions: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rows: jax.Array,
    layer: int,
    kv_len: int,
    window: int | None,
    scale: float,
    softcap: float | None,
    sinks: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Queries q [B, T, KV, G, hd] at positions [B, T] over layer `layer` of a whole stacked cache
    k, v [L, R, KV, S, hd] (float32, bfloat16 or its bits as uint16, or int8 with `k_scale`,
    `v_scale` [L, R, KV, S], each vector's scale; rows `rows` [B]), keys below `kv_len`:
    softmax(q·k · scale) · v per query, float32 [B, T, KV, G, hd], each head's sink logit (`sinks`
    [KV·G], gpt-oss's) joined to its denominator where given. Queries at positions ≥ kv_len
    (finished rows) get zeros."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    heads = q.shape[2] * q.shape[3]
    sinks = jnp.full(heads, -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    none = jnp.zeros((0,), jnp.float32)
    return jax.ffi.ffi_call("jaxinfer_attention", out)(
        q.astype(jnp.float32),
        positions.astype(jnp.int32),
        k,
        v,
        none if k_scale is None else k_scale,
        none if v_scale is None else v_scale,
        rows.astype(jnp.int32),
        sinks,
        layer=np.int64(layer),
        kv_len=np.int64(kv_len),
        window=np.int64(window or 0),
        scale=np.float32(scale),
        softcap=np.float32(softcap or 0),
    )
