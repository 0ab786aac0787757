"""Only the compiled part of the build: the CPU kernels for float and quantized matrices, for
attention and for constrained decoding's step (jaxinfer/kernels/, XLA FFI custom calls). Everything
else is in pyproject.toml.

One file per instruction-set family (generic.cc, x86_avx2.cc, x86_avx512.cc), each compiled for its
own instructions by a target region inside it, so one build runs on any CPU of its architecture and
picks its paths at run time (paths.h); on another architecture the x86 files compile to nothing.

It compiles against the FFI headers jaxlib ships (`jax.ffi.include_dir()`). Where it cannot be
built (no C++ compiler) the install still succeeds: models run on XLA's own matmuls, and constrained
output is refused in one line.
"""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL_SOURCES = ("matmul", "attention", "constrain", "paths", "generic", "x86_avx2", "x86_avx512", "arm_neon")


class BuildWithFfiHeaders(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # one compiler a core: the files are independent
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        import jax.ffi

        for extension in self.extensions:
            extension.include_dirs.append(jax.ffi.include_dir())
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "jaxinfer._kernels",
            sources=[f"jaxinfer/kernels/{name}.cc" for name in KERNEL_SOURCES],
            depends=[f"jaxinfer/kernels/{name}.h" for name in ("common", "paths", "simd")],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithFfiHeaders},
)
