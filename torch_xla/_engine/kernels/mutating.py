"""In-place and `out=` variants generated from functional kernels.

Functionalization turns user-level in-place ops into functional ones before they reach
the backend; these kernels serve PyTorch's own composite kernels, which run below
functionalization on inner tensors.
"""
from __future__ import annotations

import torch

from ..tensor import replace_state
from .op_kernel import KERNELS, OpKernel, to_copy


def overload(name: str):
    if "::" in name:
        return None
    packet, ov = name.split(".", 1)
    pk = getattr(torch.ops.aten, packet, None)
    if pk is None:
        return None
    return getattr(pk, ov, None)


class _InplaceKernel:
    """`foo_(self, ...)` on an inner tensor: the functional `foo`, then self takes the value.

    Functionalization turns user-level in-place ops into functional ones before they
    reach the backend; these kernels serve PyTorch's own composite kernels, which run
    below functionalization on inner tensors.
    """

    def __init__(self, functional: OpKernel):
        self.functional = functional

    def __call__(self, *args, **kwargs):
        out = self.functional(*args, **kwargs)
        target = args[0]
        if isinstance(out, (list, tuple)):  # _foreach_*_: self is a list
            for t, o in zip(target, out):
                replace_state(t, o._xla)
            return None
        if target.dtype != out.dtype:
            out = to_copy(out, target.dtype)
        replace_state(target, out._xla)
        return target


class _OutKernel:
    """`foo.out(..., out=)`: the functional `foo`, then `out` takes the value (and shape)."""

    def __init__(self, functional: OpKernel, out_names):
        self.functional = functional
        self.out_names = out_names

    def __call__(self, *args, **kwargs):
        outs = [kwargs.pop(n) for n in self.out_names]
        res = self.functional(*args, **kwargs)
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        for o, r in zip(outs, res):
            if o.dtype != r.dtype:
                r = to_copy(r, o.dtype)
            if tuple(o.shape) != r._xla.shape:
                o.resize_(r.shape)
            replace_state(o, r._xla)
        return outs[0] if len(outs) == 1 else tuple(outs)


def variants(special) -> dict:
    """{overload: kernel} of `foo_` and `foo.out` for every lowered functional `foo` that
    has them (and no hand-written kernel)."""
    out = {}
    for name, k in list(KERNELS.items()):
        if name.startswith("_to_copy") or name.startswith("copy"):
            continue
        packet, ov = name.split(".", 1)
        # in-place: foo_.ov
        ip = overload(f"{packet}_.{ov}")
        if ip is not None and not is_composite_implicit(ip):
            short = f"{packet}_" if ov == "default" else f"{packet}_.{ov}"
            if short not in special:
                out[short] = _InplaceKernel(k)
        # out variant: the overload of the same packet taking the same inputs plus out=.
        for oo in _out_overloads(packet):
            ins = [(a.name, str(a.type)) for a in oo._schema.arguments if not a.is_out]
            if ins == k.signature and not is_composite_implicit(oo):
                out_args = [a.name for a in oo._schema.arguments if a.is_out]
                out[oo.name().split("::")[1]] = _OutKernel(k, out_args)
                break
    return out


def _out_overloads(packet: str):
    pk = getattr(torch.ops.aten, packet, None)
    if pk is None:
        return []
    res = []
    for ov in pk.overloads():
        op = getattr(pk, ov)
        if any(a.is_out for a in op._schema.arguments):
            res.append(op)
    return res


def is_composite_implicit(op) -> bool:
    name = op.name()
    if name.endswith(".default"):
        name = name[:-len(".default")]
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    except RuntimeError:
        return False
