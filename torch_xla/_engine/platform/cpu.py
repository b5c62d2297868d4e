"""The CPU policy: compiler options per program, and host-memory pacing (`host_memory`)."""
from __future__ import annotations

import math
import re
import warnings
from typing import Iterable, Optional, Tuple

import numpy as np
import torch

from .. import env_vars, ir
from . import cpu_blas, host_memory
from .base import ALL_PRODUCTS, LONG_REDUCTIONS, NO_PRODUCTS, Policy

_BIG_BMM_BYTES = 16 << 20
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
_PIECE_OPTION = "xla_multiheap_size_constraint_per_heap"
# Only compilations this long leave enough garbage to be worth a trim (a trim walks the
# whole heap; the test suite compiles thousands of small programs).
_RELEASE_AFTER_S = 0.5
_HOST_CPU_FLAGS: Optional[frozenset] = None
_warned_unkept = False   # the per-thread arenas' warning of an array they cannot keep, given once
# Tiered compilation (executor/tiers.py): the quick tier's options, and the smallest
# program it is worth compiling twice for.
_QUICK_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
_TIER_MIN_NODES = 64


def host_cpu_flags() -> frozenset:
    """The host CPU's feature flags as Linux reports them (empty where it does not)."""
    global _HOST_CPU_FLAGS
    if _HOST_CPU_FLAGS is None:
        flags = frozenset()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = frozenset(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
        _HOST_CPU_FLAGS = flags
    return _HOST_CPU_FLAGS


# A ranked tensor type of the StableHLO text: its dimensions and element type.
_TENSOR_TYPE = re.compile(r"tensor<((?:\d+x)+)([a-z]+)(\d*)")


def largest_array_bytes(module_text: str) -> int:
    """The bytes of the largest array a StableHLO module's text names (a complex element
    counts 16 bytes, an element of unknown width 8)."""
    largest = 0
    for dims, kind, bits in set(_TENSOR_TYPE.findall(module_text)):
        itemsize = 16 if kind == "complex" else (max(1, int(bits) // 8) if bits else 8)
        largest = max(largest, math.prod(int(d) for d in dims[:-1].split("x")) * itemsize)
    return largest


def _warn_unkept(nbytes: int) -> None:
    global _warned_unkept
    if _warned_unkept:
        return
    _warned_unkept = True
    filename, lineno, module = ir.user_site()   # the line whose barrier compiles the program
    warnings.warn_explicit(
        f"torch_xla: PT_XLA_RETAIN_HOST_MEMORY=threads, and a program has an array of {nbytes / 2**20:.0f} MiB: "
        f"an arena per thread cannot keep a buffer over {host_memory.THREAD_HEAP_BYTES >> 20} MiB, so every run "
        "that allocates one maps and page-faults it afresh, which can make a step much slower. The default "
        "(PT_XLA_RETAIN_HOST_MEMORY unset or 1) keeps such buffers resident.",
        RuntimeWarning, filename, lineno, module=module)


def prepare_process() -> None:
    """Before jax starts its CPU client: keep freed host memory resident (host_memory)."""
    host_memory.configure()


def compiler_options(ops: Iterable[Tuple[str, tuple]], library_products: str = NO_PRODUCTS) -> dict:
    """XLA options for this program beyond the process-wide XLA_FLAGS.

    On a CPU without AVX-512, XLA's YNNPACK fusions make attention-shaped programs
    (batched matrix products with large outputs) slower when XLA computes those products,
    while they speed up convolution networks: such programs compile without them. With
    `library_products` (the program's float32 products are the BLAS handler's,
    lowering/blas_cpu.py) the fusions only take the program's reductions and elementwise
    work, which they run on all intra-op threads, and stay on. With AVX-512 they are
    faster for every program. XLA_FLAGS naming the option decides alone. Figures:
    BENCHMARKS.md, "What moved the figures", the YNNPACK entries, and issue 35, eighth
    session.

    XLA's other library paths stay off: in jaxlib 0.10.2 the XNNPACK options compile the
    same code, and oneDNN fusions (which need YNNPACK's off) made MNIST's step slower and
    abort the process on the decoder's program (BENCHMARKS.md, issue 35)."""
    if _YNN_OPTION in (env_vars.get("XLA_FLAGS") or ""):
        return {}
    if "avx512f" in host_cpu_flags():
        return {}
    for op, aval in ops:
        if op == "aten::bmm" or op == "aten::baddbmm":
            shape, dtype = aval
            if library_products == ALL_PRODUCTS and dtype == torch.float32:
                continue    # the handler's product
            if int(np.prod(shape)) * dtype.itemsize >= _BIG_BMM_BYTES:
                return {_YNN_OPTION: ""}
    return {}


class CpuPolicy(Policy):
    name = "CPU"
    # XLA:CPU's convolution is many times slower than a product of patches where Eigen
    # cannot take it (lowering/conv_cpu.py; BENCHMARKS.md, "Convolution formulations on XLA:CPU").
    patch_convolutions = True
    # XLA:CPU compiles no dot with an s4 operand; executed programs widen int4 weights to s8
    # after narrowing (same values); text dumps and export keep the portable s4 dot.
    widen_int4_dots = True
    # PyTorch/XLA runs a CPU job as one process driving CPU_NUM_DEVICES devices, a thread
    # per replica, so replica i computes on `xla:i`; here each replica is a process with
    # one device, which keeps that name: the replica's global ordinal.
    ordinal_device_index = True

    def compiler_options(self, ops, library_products: str = NO_PRODUCTS):
        return compiler_options(ops, library_products)

    def lowered_options(self, lowered) -> dict:
        # With an arena per thread, the temporary buffer in pieces a thread's heap can keep
        # (platform/host_memory.py). XLA warns of every buffer larger than a piece, so a
        # piece is at least the program's largest array (that one is mapped afresh at every
        # run anyway when it is over the heap's 64 MiB).
        piece = host_memory.temp_piece_bytes()
        if not piece or _PIECE_OPTION in (env_vars.get("XLA_FLAGS") or ""):
            return {}
        try:
            text = lowered.as_text()
        except Exception:  # noqa: BLE001  (a module jax cannot print: the pieces alone)
            return {_PIECE_OPTION: piece}
        largest = largest_array_bytes(text)
        if largest > host_memory.THREAD_HEAP_BYTES:
            _warn_unkept(largest)
        return {_PIECE_OPTION: max(piece, largest)}

    def library_products(self) -> str:
        # PyTorch's BLAS for float32 products (platform/cpu_blas.py). Without AVX-512 it
        # computes the decoder's products faster than XLA (BENCHMARKS.md, issue 35, sixth
        # session); with AVX-512, where YNNPACK computes XLA's products, XLA's decoder step
        # was 1.49x the handler's samples/s on an AMD EPYC, and only a long, narrow
        # reduction (MNIST's first convolution's weight gradient) stays the handler's
        # (issue 35, ninth session).
        if not cpu_blas.available():
            return NO_PRODUCTS
        return LONG_REDUCTIONS if "avx512f" in host_cpu_flags() else ALL_PRODUCTS

    def quick_compiler_options(self, nodes: int) -> Optional[dict]:
        # XLA's fusion emitters take about half of a program's CPU compile time, and for a
        # few runs the code without them is close in speed (BENCHMARKS.md, "Time to first
        # result: tiered compilation").
        return _QUICK_OPTIONS if nodes >= _TIER_MIN_NODES else None

    def before_compile(self) -> None:
        host_memory.settle(release=True)

    def after_compile(self, seconds: float) -> None:
        if seconds >= _RELEASE_AFTER_S:
            host_memory.release()

    def paced_bytes(self, compiled) -> int:
        if not host_memory.active():
            return 0
        temp = host_memory.temp_bytes(compiled)
        return temp if temp >= host_memory.LARGE_TEMP_BYTES else 0

    def before_dispatch(self, paced: int):
        return host_memory.before_dispatch() if paced else None

    def after_dispatch(self, paced: int, token, outs) -> None:
        if paced:
            host_memory.after_dispatch(paced, token, outs)
