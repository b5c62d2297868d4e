"""Pieces of `xla_builder`: functions of pytrees called over flat tensor lists
(`FlattenedInputFunc`, `CompiledCallableWithCache`, the base of `XlaCallable`), and
placeholder tensors (device data without a buffer)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ._xla_ops import _XLA_PT_TYPE_MAP, _jax, _raw_shape, _xla_type


class FlattenedInputFunc:
    """`orig_func` as three calls over flat sequences, for callers that handle tensors
    only as flat lists (a compiler, a serving runtime):
    `postprocess(flat_call(preprocess(args, kwargs)))` equals `orig_func(*args, **kwargs)`.

    `preprocess` flattens `(args, kwargs)` (PyTorch pytrees) and returns the tensor leaves;
    it keeps the other leaves and the structure, which `flat_call` puts back around the
    tensors (or whatever stands in for them, such as builder ops) it is given before
    calling `orig_func`; `flat_call` returns the result's leaves and keeps its structure
    for `postprocess`."""

    def __init__(self, orig_func: Callable):
        self.orig_func = orig_func
        self.non_tensors: Optional[tuple] = None
        self.in_spec = None
        self.out_spec = None
        self._tensor_slot = object()   # marks where a tensor leaf goes back

    def preprocess(self, args, kwargs: Optional[dict] = None) -> tuple:
        leaves, self.in_spec = self.flatten((args, kwargs or {}))
        self.non_tensors = tuple(self._tensor_slot if isinstance(v, torch.Tensor) else v for v in leaves)
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    def flat_call(self, flat_input) -> list:
        if self.in_spec is None:
            raise RuntimeError("FlattenedInputFunc.flat_call: call preprocess first (it records the inputs' structure)")
        given = iter(flat_input)
        leaves = [next(given) if v is self._tensor_slot else v for v in self.non_tensors]
        args, kwargs = self.unflatten(leaves, self.in_spec)
        out, self.out_spec = self.flatten(self.orig_func(*args, **kwargs))
        return out

    def postprocess(self, res_flattened):
        if self.out_spec is None:
            raise RuntimeError("FlattenedInputFunc.postprocess: call flat_call first (it records the result's structure)")
        return self.unflatten(list(res_flattened), self.out_spec)

    # Subclasses may flatten with another pytree library.
    def flatten(self, tree):
        from torch.utils import _pytree
        return _pytree.tree_flatten(tree)

    def unflatten(self, leaves, spec):
        from torch.utils import _pytree
        return _pytree.tree_unflatten(leaves, spec)


class CompiledCallableWithCache:
    """A function of pytrees of tensors served by programs specialised to the tensors'
    shapes and dtypes and to the other arguments (one `specialize` per combination,
    cached): a new shape builds a new program. Subclasses define `specialize`."""

    def __init__(self, flat_input_func: FlattenedInputFunc):
        self._cache: dict = {}
        self._flat_input_func = flat_input_func

    def __call__(self, *args, **kwargs):
        f = self._flat_input_func
        tensors = f.preprocess(args, kwargs)
        key = (tuple((tuple(t.shape), t.dtype) for t in tensors), f.non_tensors, f.in_spec)
        try:
            flat_callable = self._cache.get(key)
        except TypeError:   # an unhashable non-tensor argument: specialise for this call only
            key, flat_callable = None, None
        if flat_callable is None:
            flat_callable = self.specialize(tensors)
            if key is not None:
                self._cache[key] = flat_callable
        return f.postprocess(flat_callable(tensors))

    def specialize(self, sample_flat_args: Sequence[torch.Tensor]) -> Callable:
        """A function of flat tensors shaped like `sample_flat_args` returning the flat outputs."""
        raise NotImplementedError


class _NoBuffer:
    """The array of a placeholder's device-data leaf: shape, dtype and placement, and no
    buffer (a program can be printed from it, not run; reading it raises)."""
    __slots__ = ("shape", "dtype", "sharding", "__weakref__")
    placeholder = True   # how the executor tells it from a buffer (it raises on running it)
    is_fully_replicated = True
    is_fully_addressable = True

    def __init__(self, shape: tuple, dtype, sharding):
        self.shape = shape
        self.dtype = dtype
        self.sharding = sharding

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def is_deleted(self) -> bool:
        return False

    def _refuse(self):
        raise RuntimeError(f"{self!r}: a placeholder tensor has no value to read or compute with")

    def block_until_ready(self):
        self._refuse()

    def __array__(self, *args, **kwargs):
        self._refuse()

    def __repr__(self):
        return f"placeholder {_xla_type(self.dtype)}[{','.join(map(str, self.shape))}] (no device buffer)"


def _placeholder(shape) -> torch.Tensor:
    """An xla tensor of XLA array shape `shape` (a `Shape` or its raw form) whose
    device-data leaf has a `_NoBuffer`."""
    from .._engine import ir, pjrt
    from .._engine.tensor import make_tensor, wrap_user
    raw = _raw_shape(shape)
    if not isinstance(raw, dict):
        raise ValueError(f"a placeholder tensor needs an array shape, got {raw}")
    dtype = _XLA_PT_TYPE_MAP[raw['type']]
    sizes = tuple(int(d) for d in raw['sizes'])
    jax = _jax()
    sharding = pjrt._placement.sharding or jax.sharding.SingleDeviceSharding(pjrt.default_device())
    arr = _NoBuffer(sizes, pjrt.device_dtype(dtype), sharding)
    return wrap_user(make_tensor(ir.DeviceData(arr, (sizes, dtype)), 0, sizes, dtype))


class _ModuleComputation:
    """A computation given as a serialized `HloModuleProto` (`LoweringContext.hlo()`):
    printable, not callable."""

    def __init__(self, name: str, proto: bytes):
        self.name = name
        self.proto = bytes(proto)

    def hlo_text(self) -> str:
        from .._engine.executor import hlo_text
        return hlo_text.module_text(self.proto)

    def __repr__(self):
        return f"Computation({self.name}, HloModuleProto of {len(self.proto)} bytes)"


def computation_from_module_proto(name: str, module_proto: bytes) -> _ModuleComputation:
    """A printable computation of a serialized HloModuleProto (`LoweringContext.hlo()`)."""
    if not isinstance(module_proto, (bytes, bytearray)):
        raise TypeError(f"module_proto must be bytes (a serialized HloModuleProto), got {type(module_proto).__name__}")
    return _ModuleComputation(name, module_proto)
