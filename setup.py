"""Only the compiled part of the build: the CPU matmul kernel for quantized weights
(jaxinfer/kernels/qmatmul.cc, an XLA FFI custom call). Everything else is in pyproject.toml.

It compiles against the FFI headers jaxlib ships (`jax.ffi.include_dir()`). Where it cannot be
built (no C++ compiler) the install still succeeds and quantized models run on the pure-JAX path.
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
            "jaxinfer._qmatmul",
            sources=["jaxinfer/kernels/qmatmul.cc"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithFfiHeaders},
)
