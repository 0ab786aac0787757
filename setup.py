"""Only the compiled part of the build: the CPU matmul kernels for float and quantized weights
(jaxinfer/kernels/matmul.cc, XLA FFI custom calls). Everything else is in pyproject.toml.

It compiles against the FFI headers jaxlib ships (`jax.ffi.include_dir()`). Where it cannot be
built (no C++ compiler) the install still succeeds and models run on XLA's own matmuls.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildWithFfiHeaders(build_ext):
    def build_extensions(self):
        import jax.ffi

        for extension in self.extensions:
            extension.include_dirs.append(jax.ffi.include_dir())
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "jaxinfer._kernels",
            sources=["jaxinfer/kernels/matmul.cc", "jaxinfer/kernels/attention.cc"],
            depends=["jaxinfer/kernels/common.h"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithFfiHeaders},
)
