"""Float matrices packed for the CPU kernel (`jaxinfer.packed`): the kernel against numpy on odd
shapes, on each code path (AMX too where the CPU has it), in float32 and bfloat16; the layouts and
their lookups; the switch that turns AMX off (a packed model against transformers and the other
layouts is test_parity's)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import needs_kernel, xla_dot

from jaxinfer import kernel, packed

# (out, in, rows): out not a multiple of the tiles' groups (AVX-512: 4, AVX2: 4 for one row, 2 for
# two or three), in odd, rows around the tiles' rows (AVX-512: 6; AVX2: 1, 2, 6); from 16 rows
# bfloat16 weights take AMX where the CPU has it: an odd count of groups, in not a multiple of its 32,
# rows not a multiple of its 32, in over its 2048 a pass, and rows enough for XLA's pool to share the
# packing (32 blocks of 16); and 3–32 rows over blocks of 16 KiB of weights (64, 128 or 256 in by the
# tile's groups), a last one short, with the tile that fetches ahead a whole one and a short one
SHAPES = [
    (16, 37, 1),
    (48, 96, 3),
    (80, 64, 6),
    (160, 33, 7),
    (64, 160, 13),
    (16, 8, 130),
    (80, 100, 40),
    (48, 37, 33),
    (160, 576, 64),
    (48, 2100, 40),
    (32, 64, 512),
    (80, 300, 11),
    (32, 200, 32),
    (64, 600, 16),
    (64, 300, 3),
    (80, 70, 2),
]


def problem(n, k, m, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((n, k)), dtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    return x, w


@needs_kernel
@pytest.mark.parametrize(  # bfloat16 matrices of odd in are not packed (test_what_is_packed)
    "dtype,n,k,m",
    [
        (dtype, *shape)
        for dtype in (jnp.float32, jnp.bfloat16)
        for shape in SHAPES
        if dtype == jnp.float32 or shape[1] % 2 == 0
    ],
)
@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_kernel_is_the_float32_product(isa, dtype, n, k, m, bf16_inputs):
    """Every weight widened exactly to float32, sums in float32: within float32 rounding of the
    float64 product (|error| ≤ k·eps·Σ|x·w| per output). AMX multiplies bfloat16 by bfloat16, so
    there x is carried as two bfloat16 parts, 16 significant bits: 2^-16·Σ|x·w| more. With
    `bf16_inputs` every path multiplies x rounded to bfloat16, and AMX takes it in one part exactly."""
    x, w = problem(n, k, m, dtype)
    ours = np.asarray(jax.jit(packed.matmul, static_argnums=2)(x, packed.pack(w), bf16_inputs))
    if bf16_inputs:
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    exact = x.astype(np.float64) @ w64.T
    amx = dtype == jnp.bfloat16 and isa == "native" and kernel.isa().endswith("amx")
    carried = 2.0**-16 if amx and not bf16_inputs else 0.0
    bound = (k * np.finfo(np.float32).eps + carried) * (np.abs(x) @ np.abs(w64).T) + 1e-30
    assert ours.dtype == np.float32 and ours.shape == (m, n)
    np.testing.assert_array_less(np.abs(ours - exact), bound)


@needs_kernel
def test_kernel_and_xla_agree_on_a_batch_of_rows():
    """[B, T, in] inputs keep their leading axes, on the kernel and on XLA's dot alike."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
    leaf = packed.pack(jnp.asarray(rng.standard_normal((96, 64)), jnp.float32))
    ours = packed.matmul(x, leaf)
    with xla_dot():
        plain = packed.matmul(x, leaf)
    assert ours.shape == plain.shape == (2, 5, 96)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-5)
    rounded = packed.matmul(x, leaf, bf16_inputs=True)
    with xla_dot():
        plain = packed.matmul(x, leaf, bf16_inputs=True)
    np.testing.assert_allclose(rounded, plain, rtol=1e-5, atol=1e-5)
    assert np.abs(rounded - ours).max() > 1e-4  # the rounding is there, on both paths


@pytest.mark.parametrize("dtype, shape", [(jnp.float32, (3, 8, 16)), (jnp.bfloat16, (3, 4, 16, 2))])
def test_packing_round_trips_and_looks_rows_up(dtype, shape):
    w = jnp.arange(48 * 8, dtype=jnp.float32).reshape(48, 8).astype(dtype)
    leaf = packed.pack(w)
    assert leaf.shape == shape
    at = leaf[1, 2, 3]  # output 16 + 3, input 2 (float32) or inputs 4 and 5 (bfloat16)
    np.testing.assert_array_equal(at, w[19, 2] if dtype == jnp.float32 else w[19, 4:6])
    np.testing.assert_array_equal(packed.unpack(leaf), w)
    ids = jnp.asarray([[0, 17, 47], [5, 5, 32]])
    np.testing.assert_array_equal(packed.take_rows(leaf, ids, jnp.float32), w[ids].astype(jnp.float32))
    with xla_dot():  # the layout's own product, where the kernel is not built
        x = jnp.ones((2, 8), jnp.float32)
        np.testing.assert_array_equal(packed.matmul(x, leaf), x @ w.astype(jnp.float32).T)


def test_what_is_packed():
    assert packed.packable(jnp.zeros((32, 6), jnp.bfloat16)) and packed.packable(jnp.zeros((32, 5), jnp.float32))
    assert not packed.packable(jnp.zeros((32, 5), jnp.bfloat16))  # no whole pairs
    assert not packed.packable(jnp.zeros((24, 6), jnp.float32)) and not packed.packable(jnp.zeros((32, 6), jnp.float16))


@needs_kernel
def test_on_the_portable_path_float_matrices_stay_on_xlas_dot(isa):
    """The portable C++ path (a CPU with neither AVX2 nor AVX-512, forced here) rereads the weights
    for every row: loading then picks XLA's layouts, [out, in] for one row and [in, out] for batches."""
    from jaxinfer import kernel
    from jaxinfer.forms import layout_for_batch

    if kernel.isa() == "generic":
        assert (layout_for_batch(1), layout_for_batch(8)) == ("out_in", "in_out")
    else:
        assert (layout_for_batch(1), layout_for_batch(8)) == ("packed", "packed")


@needs_kernel
@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="the CPU's flags are read from /proc/cpuinfo")
def test_each_cap_names_the_family_this_cpu_has():
    """`isa()` under each cap names the best family the CPU has at or below it, and what it adds, as
    /proc/cpuinfo's flags (x86) or features (ARM) say."""
    key = "Features" if "neon" in kernel.ISA_CAPS else "flags"
    lines = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(key)]
    if not lines:  # qemu-user shows the host's
        pytest.skip(f"/proc/cpuinfo has no {key!r} line: it describes another architecture")
    flags = set(lines[0].split(":")[1].split())
    families = [  # (the highest cap level that keeps it, family, the CPU has it)
        (1, "avx512", {"avx512f", "avx512bw", "avx512vl"} <= flags),
        (3, "avx2", {"avx2", "fma"} <= flags),
        (3, "neon", "asimd" in flags),
        (4, "generic", True),
    ]
    for cap, level in kernel.ISA_CAPS.items():
        with kernel.capped(cap):
            level = max(level, kernel._own_cap())
            family, *adds = kernel.isa().split("-")
            assert family == next(name for at, name, has in families if at >= max(level, 1) and has), cap
            assert ("amx" in adds) == (level == 0 and "amx_tile" in flags and family == "avx512"), cap
            assert ("dotprod" in adds) == (level < 3 and "asimddp" in flags), cap
            if family == "avx2":  # AVX-VNNI: /proc/cpuinfo's avx_vnni
                assert ("vnni" in adds) == (level < 3 and "avx_vnni" in flags), cap


@needs_kernel
def test_the_environment_picks_the_path():
    """JAXINFER_ISA=avx2 (ARM: neon) gives the base vector paths where the CPU has them (a fresh
    process: it is read at load), as the tests' cap does; a name that is no cap is refused in one line."""
    show = [sys.executable, "-c", "from jaxinfer import kernel; print(kernel.isa())"]
    env = {key: value for key, value in os.environ.items() if key != "JAXINFER_ISA"}
    base = next(cap for cap, level in kernel.ISA_CAPS.items() if level >= 3)
    run = subprocess.run(show, env={**env, "JAXINFER_ISA": base}, capture_output=True, text=True, check=True)
    if kernel.ISA_CAPS[os.environ.get("JAXINFER_ISA", "native")] <= kernel.ISA_CAPS[base]:  # not capped below it
        with kernel.capped(base):
            assert run.stdout.strip() == kernel.isa()
    bad = subprocess.run(show, env={**env, "JAXINFER_ISA": "avx3"}, capture_output=True, text=True)
    assert bad.returncode != 0 and f"JAXINFER_ISA must be one of {', '.join(kernel.ISA_CAPS)}, not 'avx3'" in bad.stderr
