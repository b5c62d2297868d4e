"""Shape inference: a kernel's output avals for one (op, input avals, static args).

PyTorch's meta kernel (or the lowering's own `meta`) runs once per combination on meta
tensors; its exception, raised at the op's line, is PyTorch's own (an IndexError is also
a RuntimeError, as PyTorch/XLA raises: `messages.XlaIndexError`). An op whose outputs
the meta kernel cannot compute goes to the CPU fallback, decided here once per
combination: no Meta-capable kernel registered, NotImplementedError, or an error that
says the kernel needed the tensors' data (data-dependent output shapes: nonzero,
masked_select, unique...).
"""
from __future__ import annotations

import torch
from torch import _prims_common
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

from .. import pjrt
from ..tensor import state_of
from . import messages
from .plan import OPT_SCALAR, OPT_TENSOR, OPT_TENSOR_LIST, SCALAR, TENSOR, TENSOR_LIST

_DEFAULT_KIND = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
_META = torch.device("meta")
# Dispatch keys whose kernel serves meta tensors.
_META_KEYS = ("Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
              "CompositeExplicitAutogradNonFunctional")
_has_meta_cache = {}
# PyTorch's words for "this meta kernel needs the tensor's data": `.item()` and
# data-dependent sizes on meta tensors raise RuntimeError with one of these.
_NEEDS_DATA = ("data-dependent", "cannot be called on meta tensors", "on a meta tensor",
               "Cannot copy out of meta tensor", "meta tensors do not have data")


class ShapeEntry:
    """What the meta kernel told us about one (op, avals, statics) combination."""
    __slots__ = ("avals", "structure", "common", "fallback", "base", "proto")

    def __init__(self, avals, structure, common, fallback=False):
        self.base = None  # ir.node_base of the nodes built from this entry (set by the kernel)
        # The DLPack record of its (first) output on this process's device when that is
        # not xla:0 (tensor.creation_function; set by the specialised kernels at first use).
        self.proto = None
        self.avals = avals
        self.structure = structure  # "one" | "tuple" | "list"
        self.common = common
        self.fallback = fallback


def _has_meta(op) -> bool:
    name = op.name()
    got = _has_meta_cache.get(name)
    if got is None:
        n = name[:-len(".default")] if name.endswith(".default") else name
        got = any(torch._C._dispatch_has_kernel_for_dispatch_key(n, key) for key in _META_KEYS)
        _has_meta_cache[name] = got
    return got


def _needs_data(e: RuntimeError) -> bool:
    msg = str(e)
    return any(w in msg for w in _NEEDS_DATA)


def to_meta(t: torch.Tensor):
    """A meta tensor with the aval of `t` (a 0-d CPU tensor stays: a wrapped number)."""
    if t.device.type == "xla":
        s = t._xla if hasattr(t, "_xla") else state_of(t)
        return torch.empty(s.shape, dtype=s.dtype, device=_META)
    if t.dim() == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=_META)


def infer(k, args) -> ShapeEntry:
    """The ShapeEntry of kernel `k` called with `args` (full, in schema order)."""
    margs = []
    promo = []
    for i, kind in enumerate(k.kinds):
        v = args[i]
        if kind == TENSOR and not isinstance(v, torch.Tensor):
            kind = SCALAR
        if kind in (TENSOR, OPT_TENSOR):
            if v is None:
                margs.append(None)
            else:
                m = to_meta(v)
                margs.append(m)
                promo.append(m)
        elif kind in (TENSOR_LIST, OPT_TENSOR_LIST):
            ms = [None if t is None else to_meta(t) for t in v]
            margs.append(ms)
            promo.extend(m for m in ms if m is not None)
        elif kind in (SCALAR, OPT_SCALAR):
            if isinstance(v, torch.Tensor):
                v = v.item()
            margs.append(v)
            if v is not None:
                promo.append(v)
        else:
            if isinstance(v, torch.device) and v.type == "xla":
                v = _META
            margs.append(v)
    kwargs = {}
    schema_args = k.op._schema.arguments
    pos = []
    for a, m in zip(schema_args, margs):
        if a.kwarg_only:
            kwargs[a.name] = m
        else:
            pos.append(m)
    if k.low.meta is None and not _has_meta(k.op):
        return ShapeEntry((), "one", None, fallback=True)
    try:
        if k.low.meta is not None:
            out = k.low.meta(*pos, **kwargs)
        else:
            out = k.op(*pos, **kwargs)
    except NotImplementedError:
        # No meta kernel for this combination of arguments (PyTorch raises this type).
        return ShapeEntry((), "one", None, fallback=True)
    except (RuntimeError, ValueError, IndexError) as e:
        if isinstance(e, RuntimeError) and _needs_data(e):
            return ShapeEntry((), "one", None, fallback=True)
        # PyTorch/XLA's more precise wording of some checks (PyTorch's type kept; an
        # IndexError is also a RuntimeError, as PyTorch/XLA raises: messages.XlaIndexError)
        worded = messages.reword(k.name, {a.name: m for a, m in zip(schema_args, margs)}, e)
        if worded is e:
            raise
        raise worded from None
    if isinstance(out, torch.Tensor):
        structure, outs = "one", (out,)
    elif isinstance(out, tuple):
        structure, outs = "tuple", out
    else:
        structure, outs = "list", tuple(out)
    avals = []
    for o in outs:
        if o is None:
            avals.append(None)
        else:
            if not pjrt.is_supported_dtype(o.dtype):
                raise TypeError(f"dtype {o.dtype} is not supported on the xla device")
            avals.append((tuple(o.shape), o.dtype))
    common = None
    first = avals[0] if avals and avals[0] is not None else None
    if promo:
        try:
            # Looked up on the module: patch `lazy_symbolic_shapes` stands in for it until sympy loads.
            common = _prims_common.elementwise_dtypes(*promo, type_promotion_kind=_DEFAULT_KIND)[1]
        except Exception:
            common = first[1] if first else None
        if first is not None and common is not None:
            od = first[1]
            if (od.is_floating_point or od.is_complex) and not (common.is_floating_point or common.is_complex):
                common = od
    elif first is not None:
        common = first[1]
    if k.low.promote and common in (torch.bfloat16, torch.float16):
        # Like PyTorch's CPU kernels, compute half-precision elementwise math in float32
        # and round once at the end.
        common = torch.float32
    return ShapeEntry(tuple(avals), structure, common)


