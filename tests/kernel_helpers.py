"""For tests of the CPU kernels (`jaxinfer.kernel`): skip where they were not built, run a block on
XLA's dot instead, and the `isa` fixture (in conftest) that runs a test on each code path."""

import contextlib

import pytest

from jaxinfer import kernel

needs_kernel = pytest.mark.skipif(kernel.isa() is None, reason="the kernels were not built")


@contextlib.contextmanager
def xla_dot():
    """Inside: every matrix on XLA's dot, as where the kernels are not built (fresh traces only)."""
    kernel.enabled = False
    try:
        yield
    finally:
        kernel.enabled = True
