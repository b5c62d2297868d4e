"""float32 matrix products of CPU programs computed by the BLAS PyTorch's CPU kernels use.

XLA:CPU's batched products of attention's sizes (64 products of 256 x 32 x 256) run at
a third to a half of the speed of the BLAS eager PyTorch calls, and a product whose left
operand is transposed (every weight gradient `gᵀ·x`) at 0.5-0.8x (BENCHMARKS.md, issue
35). The native handler `_cpu_blas` (csrc/cpu_blas.cc, an XLA FFI handler built with the
package) computes such a product inside the XLA program with PyTorch's `sgemm`, split
over the program's intra-op threads; `lowering/blas_cpu.py` emits its calls.

`available()` registers the handler with jax once. It is False (and XLA computes every
product) when the opt-out `PT_XLA_CPU_BLAS=0` is set, when the package was installed
without its native part (no C++ compiler), or when PyTorch's CPU library exports no MKL
(`sgemm` and MKL's per-thread thread count, which keeps each call on one thread).
"""
from __future__ import annotations

import ctypes
import importlib
import os

from .. import patches
from ..tensor import _capsule_new   # the engine's own prototype (not ctypes.pythonapi's shared one)

TARGET = "torch_xla_cpu_matmul_f32"


def available() -> bool:
    """Whether CPU programs may call the handler (registered on the first call: patch
    `cpu_blas_target`)."""
    return patches.install("cpu_blas_target")


def _blas():
    """(sgemm, MKL's per-thread thread count setter) of PyTorch's CPU library, or None."""
    import torch
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return ctypes.cast(lib.sgemm, ctypes.c_void_p), ctypes.cast(lib.MKL_Set_Num_Threads_Local, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None


def register() -> bool:
    """Registers the handler with jax; False when the native part or MKL is missing."""
    try:
        native = importlib.import_module(__package__ + "._cpu_blas")
    except ImportError:  # installed without a C++ compiler
        return False
    blas = _blas()
    if blas is None:
        return False
    import jax
    lib = ctypes.CDLL(native.__file__)
    lib.torch_xla_cpu_blas_set.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    lib.torch_xla_cpu_blas_set(*blas)
    handler = _capsule_new(ctypes.cast(lib.TorchXlaCpuMatMulF32, ctypes.c_void_p), None, None)
    jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    return True
