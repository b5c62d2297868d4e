"""The kernels of the `xla` device: the only package that calls `torch.library`.

`register()` installs everything, key by key:

- PrivateUse1: a kernel per lowered aten overload (`op_kernel`, specialised on first call
  by `specialise`), in-place and `out=` variants (`mutating`), ops served by PyTorch's
  decompositions (`decompositions`), hand-written kernels (`handwritten`: factories,
  transfers, copies, batch norm, Scalar[] foreach overloads, transpositions and
  `as_strided`), `set_` from a storage
  (`storage`: tensors loaded by `torch.load(..., map_location='xla')`), and the CPU
  fallback for every other op (`fallback`);
- AutogradPrivateUse1: the derivative of `_fft_r2c` (`handwritten`);
- AutocastPrivateUse1: `torch.autocast("xla")`'s op policy (`autocast`), a fallthrough
  for every other op; the GradScaler ops are PrivateUse1 kernels (`grad_scaling`);
- QuantizedPrivateUse1: `empty_quantized`, refused by dtype.

The Functionalize kernels of `copy_` and `_to_copy` (`functionalize`) and the lean Meta
checks of in-place elementwise ops (`meta`) are patch registry entries of their own
(`functionalize_copy`, `functionalize_to_copy`, `lean_inplace_meta`), installed after this.
"""
from __future__ import annotations

import functools
import time
from typing import List, Sequence, Tuple

import torch

from .. import env_vars, executor, ir, telemetry, mode
from ..lowering import LOWERINGS, load_all
from ..tensor import make_tensor, state_of, wrap_user
from . import (bounded, grad_scaling, autocast, compiled_ops, decompositions, handwritten as hw, library, mutating, nn_chunked,
               storage, values)
from .fallback import cpu_fallback, fallback_kernel
from .op_kernel import KERNELS, OpKernel, freeze
from .specialise import entry_point
from .values import from_cpu, set_data, to_cpu

__all__ = ["register", "engine_op", "KERNELS", "cpu_fallback", "from_cpu", "to_cpu", "set_data"]

HANDWRITTEN = {
    "empty.memory_format": hw.k_empty,
    "empty_strided": hw.k_empty_strided,
    "zeros_like": hw.k_zeros_like,
    "ones_like": hw.k_ones_like,
    "_to_copy": hw.k_to_copy,
    "_copy_from": hw.k_copy_from,
    "copy_": hw.k_copy_,
    "copy": hw.k_copy,
    "_local_scalar_dense": hw.k_local_scalar_dense,
    "is_pinned": hw.k_is_pinned,
    "equal": hw.k_equal,
    "_ctc_loss.Tensor": hw.k_ctc_loss_tensor,
    "_ctc_loss_backward.Tensor": hw.k_ctc_loss_backward_tensor,
    "set_.source_Tensor": hw.k_set_source,
    "resize_": values.resize_,
    # `native_batch_norm` updates its running statistics in place although its schema
    # does not say so: a pure lowering would lose the update.
    "native_batch_norm": hw.k_native_batch_norm,
    "_native_batch_norm_legit": hw.k_native_batch_norm_legit,
    # Transpositions report eager's strides (autograd reads them) and fold x.t().t().
    "t_copy": hw.transposition("t_copy.default"),
    "transpose_copy.int": hw.transposition("transpose_copy.int"),
    "permute_copy": hw.transposition("permute_copy.default"),
    "as_strided_copy": hw.k_as_strided_copy,
    "as_strided_scatter": hw.k_as_strided_scatter,
}


def _timed(fn):
    """`fn`, timed as `LazyTracing` (hand-written kernels: transfers, copies, factories)."""
    now = time.perf_counter_ns

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        t0 = now()
        try:
            return fn(*args, **kwargs)
        finally:
            telemetry.add_sample("LazyTracing", now() - t0)
    return kernel


def register() -> None:
    """Installs every kernel of the xla device (patch `xla_kernels`; once, by the registry)."""
    load_all()
    for name, low in LOWERINGS.items():
        op = mutating.overload(name)
        if op is None:
            continue
        k = OpKernel(op, low)
        KERNELS[name] = k
        short = name[:-len(".default")] if name.endswith(".default") else name
        if short in HANDWRITTEN or name in HANDWRITTEN:
            continue
        if mutating.is_composite_implicit(op):
            # PyTorch decomposes these above autograd; a backend kernel would hide their
            # derivative. Their lowering still serves dynamo/export graphs.
            continue
        library.impl(short, entry_point(k, short), "PrivateUse1")
    for short, fn in mutating.variants(HANDWRITTEN).items():
        library.impl(short, fn, "PrivateUse1")
    for short, fn in decompositions.kernels(LOWERINGS).items():
        library.impl(short, fn, "PrivateUse1")
    for name, fn in HANDWRITTEN.items():
        library.impl(name, _timed(fn), "PrivateUse1")
    for name, fn in storage.KERNELS.items():
        library.impl(name, _timed(fn), "PrivateUse1")
    for name, fn in hw.foreach_scalarlist_kernels().items():
        library.impl(name, fn, "PrivateUse1")
    for name, fn in grad_scaling.KERNELS.items():
        library.impl(name, fn, "PrivateUse1")
    for name, fn in autocast.kernels().items():
        library.impl(name, fn, "AutocastPrivateUse1")
    library.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    library.fallback(fallback_kernel, "PrivateUse1")
    compiled_ops.register(library, engine_op)
    nn_chunked.register()
    if env_vars.get("XLA_HLO_DEBUG"):
        ir.record_sources()
    library.impl("_fft_r2c", hw.k_fft_r2c_autograd, "AutogradPrivateUse1")
    # Quantized CPU tensors reach the device through empty_quantized: refuse by dtype.
    library.impl("empty_quantized", hw.k_empty_quantized, "QuantizedPrivateUse1")
    if bounded.any_enabled():
        bounded.register(library, KERNELS, HANDWRITTEN, _timed)


def engine_op(name: str, inputs: Sequence[torch.Tensor], statics: tuple,
              avals: Sequence[Tuple[tuple, torch.dtype]]) -> List[torch.Tensor]:
    """Applies engine op `name` (a lowering registered as "xla::...") to XLA tensors.

    The lowering receives the inputs' jax values followed by `statics`; `avals` are the
    (shape, dtype) of its outputs. Returns new user-level XLA tensors.
    """
    operands = []
    for t in inputs:
        s = state_of(t)
        operands.append((s.node, s.idx))
    args = tuple(ir.ref(i) for i in range(len(operands))) + tuple(freeze(v) for v in statics)
    node = ir.Node(name, tuple(operands), args, tuple((tuple(sh), dt) for sh, dt in avals),
                   LOWERINGS[name], None)
    outs = [make_tensor(node, i, tuple(sh), dt) for i, (sh, dt) in enumerate(avals)]
    if mode.modes.eager and outs:
        # Eager mode runs an engine op (a collective, a barrier, ...) as it runs any other op.
        executor.execute([o._xla for o in outs], metric="EagerOpExecuteTime")
    return [wrap_user(o) for o in outs]
