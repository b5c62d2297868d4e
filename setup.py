"""Builds the one native piece: the CPU platform's matrix-product handler
(torch_xla/_engine/platform/csrc/cpu_blas.cc, an XLA FFI handler compiled against the
installed jaxlib's FFI headers). It is optional: without a C++ compiler the package
installs without it and XLA computes every product (platform/cpu_blas.py)."""
import os

from setuptools import Extension, setup


def _ffi_include() -> str:
    import jaxlib
    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


setup(ext_modules=[Extension(
    "torch_xla._engine.platform._cpu_blas",
    sources=["torch_xla/_engine/platform/csrc/cpu_blas.cc"],
    include_dirs=[_ffi_include()],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-w"],
    optional=True,
)])
