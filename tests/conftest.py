import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The tests run the installed jaxinfer, as the `jaxinfer` command they start does. `python -m pytest`
# puts the checkout first on sys.path, and its jaxinfer/ lacks what only installing puts there
# (jaxinfer.cli and jaxinfer.models, from cli/ and models/; the compiled kernels): after a plain
# `pip install .` it would shadow the install. An editable install maps jaxinfer to this checkout,
# cli/ and models/ included, so there nothing changes.
CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != CHECKOUT]

# Tests must not write to the user's cache, nor read programs compiled by another version. The
# machine's ceilings (for MFU/MBU) are measured once per test session, in a cache of its own, and
# the `jaxinfer` processes the tests start share one compiled-program cache for the session, as a
# user's runs share theirs (each process compiled the same few programs again: ~1–3 s a start).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxinfer-test-cache-")
os.environ.setdefault("JAXINFER_CACHE_DIR", os.path.join(os.environ["XDG_CACHE_HOME"], "programs"))
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)  # one per session, not left behind

# Two workers (pyproject's `-n 2`) share one GPU where there is one: each allocates what it uses, not
# JAX's default of 75% of the GPU's memory each (two of those do not fit).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The suite's time is XLA compiling (test_speculation.py: 114 of its 160 s, a 2-core Zen 4), and it
# checks what programs compute, not how fast: its programs (and the `jaxinfer` processes') compile
# without LLVM's optimizations: that file 160 → 107 s, test_parity.py and test_logprobs.py 211 →
# 142 s, all passing. What they compute moves by rounding only (the bundled model's float32 logits,
# up to 16.8, by 1.2e-5 at most, XLA's path and the kernels'; every greedy token the same). Where
# XLA_FLAGS already chooses a level, that level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import pytest  # noqa: E402 (after the environment above)
from tiny_models import make_model  # noqa: E402

try:
    import jaxinfer.cli  # noqa: F401
    from jaxinfer import kernel, runtime
except ImportError as e:
    pytest.exit(f"jaxinfer is not installed ({e}): pip install -e '.[test]' (README, Install for development)", 4)


# The test process reads and writes the session's program cache too: after `_release_compiled_programs`
# a later file's identical programs (the same tiny models' steps) are read back, not compiled again
# (test_parity, test_speculation and test_logprobs together 335 → 298 s).
runtime.enable_compilation_cache()


# The longest files first, longest-processing-time order (seconds, summed over the file's tests in a
# 2-core run with --durations=0, 2026-11-29): the two workers take whole files in collection order, and
# one of these begun last ran on alone while the other idled (simulated over that run: 1635 against
# 1553 s of work with the seven longest first, 1595 and 1593 with these sixteen).
LONGEST_FIRST = (
    "test_parity.py",  # 361
    "test_gguf.py",  # 268
    "test_hybrid.py",  # 219
    "test_speculation.py",  # 197
    "test_quant.py",  # 184
    "test_sharding.py",  # 163
    "test_batch.py",  # 142
    "test_chunked_prefill.py",  # 128
    "test_cli.py",  # 123
    "test_gpu_attention.py",  # 114
    "test_attention_kernel.py",  # 102
    "test_moe.py",  # 101
    "test_constrain.py",  # 90
    "test_server.py",  # 89
    "test_logprobs.py",  # 85
    "test_draft_model.py",  # 78
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected


def pytest_report_header() -> str:
    where = Path(jaxinfer.__file__).parent
    return f"jaxinfer from {where} ({'this checkout' if where.parent == CHECKOUT else 'installed'}), kernels: " + (
        kernel.isa() or "not built"
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """XLA CPU maps each compiled program's code into the process, and the suite compiles thousands
    of programs in one: the kernel's limit on a process's mappings (vm.max_map_count, 65,530 by
    default) was 51,381 used 40% of the way through, and the compiles in test_generation then
    segfaulted inside XLA (about one full run in two on a 2-core Zen 4). A finished file's
    programs are dropped with it."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(arch, tokenizer="bpe") → path of a saved random-weight HF model (built once per session)."""
    built = {}

    def get(arch: str = "llama", tokenizer: str = "bpe", **overrides):
        key = (arch, tokenizer, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_model(tmp_path_factory.mktemp(f"{arch}-{tokenizer}"), arch, tokenizer, **overrides)
        return built[key]

    return get


def _distinct_caps() -> dict[str, str]:
    """Each cap whose paths differ from every better cap's on this CPU (under JAXINFER_ISA): cap → isa()."""
    if kernel.isa() is None:
        return {}
    seen = {}
    for cap in kernel.ISA_CAPS:
        with kernel.capped(cap):
            seen.setdefault(kernel.isa(), cap)
    return {cap: name for name, cap in seen.items()}


DISTINCT_CAPS = _distinct_caps()


@pytest.fixture(params=list(kernel.ISA_CAPS))
def isa(request):
    """Each code path of the CPU kernels this CPU can take: its best, AVX-512 without AMX, AVX2 with
    AVX-VNNI, AVX2 (ARM: NEON without SDOT), the portable one (those a cap leaves the same as a better
    cap's are skipped)."""
    if request.param not in DISTINCT_CAPS:
        pytest.skip(
            "the same paths as a better cap on this "
            f"CPU{' under JAXINFER_ISA' if os.environ.get('JAXINFER_ISA') else ''}"
        )
    with kernel.capped(request.param):
        yield request.param
