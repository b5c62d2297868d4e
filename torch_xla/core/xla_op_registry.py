"""Ops written with `torch_xla.core.xla_builder`, callable on xla tensors.

`register(name, fn)` returns a callable: called on xla tensors (and keyword arguments
passed to `fn`), it builds `fn`'s computation for those tensors' shapes once, caches it
per shapes and arguments, and applies it inside the lazy graph. The result is a tensor,
or a list of tensors when `fn` returns a tuple of more than one op.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict

import torch

from . import xla_builder as xb


class Op:
    """A named op built with `xla_builder` (see `register`)."""

    def __init__(self, name: str, opfn: Callable):
        self._name = name
        self._opfn = opfn
        self._computations: Dict[tuple, xb.Computation] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: torch.Tensor, **kwargs):
        shapes = xb.tensor_shape(args)
        key = (tuple((s.dtype, s.sizes) for s in shapes), _freeze(kwargs))
        with self._lock:
            computation = self._computations.get(key)
            if computation is None:
                computation = xb.create_computation(self._name, self._opfn, shapes, **kwargs)
                self._computations[key] = computation
        result = xb.user_computation('xla::_op_' + self._name, args, computation)
        return result[0] if len(result) == 1 else result


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return (type(v).__name__, v)


def register(name: str, opfn: Callable) -> Op:
    """A callable applying `opfn(*param_ops, **kwargs)`'s computation to xla tensors."""
    return Op(name, opfn)
