"""Lean meta checks for in-place elementwise ops under functionalization.

Functionalization checks an in-place op by running it on meta tensors before turning it
into its functional form. For these ops PyTorch's meta kernel is Python code costing tens
of microseconds per call, more than tracing the op. Inside that check (the dispatcher has
Functionalize excluded there), the kernel below runs PyTorch's own meta kernel once per
(op, shapes, dtypes, scalar types) and skips it when the same combination passed before.
Anywhere else, a plain meta tensor for instance, it calls PyTorch's kernel unchanged, so
its behaviour and errors are PyTorch's (patch registry entry `lean_inplace_meta`).
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from . import library

INPLACE_ELEMENTWISE = (
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar",
    "div_.Tensor", "div_.Scalar", "div_.Tensor_mode", "div_.Scalar_mode", "addcmul_", "addcdiv_",
    "lerp_.Scalar", "lerp_.Tensor", "clamp_", "clamp_.Tensor", "clamp_min_", "clamp_max_",
    "sqrt_", "rsqrt_", "exp_", "log_", "neg_", "abs_", "sigmoid_", "tanh_", "relu_",
    "pow_.Scalar", "pow_.Tensor", "reciprocal_", "sign_", "floor_", "ceil_", "round_", "trunc_",
    "masked_fill_.Scalar", "masked_fill_.Tensor",
)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize
_passed = set()


def _key(name, args, kwargs):
    key = [name]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.dtype))
        elif type(a) is int:
            key.append((int, a < 0))  # a negative integer exponent is an error for integers
        else:
            key.append(type(a))
    for k, v in kwargs.items():
        key.append((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)))
    return tuple(key)


def _make(name: str, original: Callable):
    def meta(*args, **kwargs):
        if not _excluded(_FUNCTIONALIZE):
            return original(*args, **kwargs)
        key = _key(name, args, kwargs)
        if key in _passed:
            return args[0]
        out = original(*args, **kwargs)
        _passed.add(key)
        return out
    meta.__name__ = f"lean_meta_{name}"
    return meta


def kernels() -> Dict[str, Callable]:
    """{overload: Meta kernel} for the listed ops whose Meta kernel is PyTorch's Python one
    (the function itself is wrapped, so it must be there to be called)."""
    out = {}
    for name in INPLACE_ELEMENTWISE:
        packet, _, ov = name.partition(".")
        pk = getattr(torch.ops.aten, packet, None)
        op = getattr(pk, ov or "default", None) if pk is not None else None
        if op is None:
            continue
        original = op.py_kernels.get(torch._C.DispatchKey.Meta)
        if original is None or not callable(original):
            continue
        out[name] = _make(name, original)
    return out


def install() -> None:
    """Patch `lean_inplace_meta`."""
    for name, fn in kernels().items():
        library.override(name, fn, "Meta")
