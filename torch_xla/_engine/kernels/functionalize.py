"""The Functionalize kernels of `aten::copy_` and `aten::_to_copy` (patch registry entries
`functionalize_copy`, `functionalize_to_copy`).

`cpu.copy_(xla)` reaches functionalization with a plain destination and a functional
source: `load_state_dict` into a CPU model, and DDP's C++ code
(verify_params_across_processes, Reducer::sync_bucket_indices). PyTorch's kernel refuses
that for every device but DeviceType::XLA ("mutating a non-functional tensor with a
functional tensor is not allowed"); ours is PrivateUse1 named "xla". This kernel does what
PyTorch's does and, in that case, reads the source to the destination's device first.

`x.to(dtype)` of an xla tensor: PyTorch's `_to_copy` kernel returns a plain (unwrapped)
tensor for every device but XLA and Lazy. A plain tensor saved by autograd as an output
(relu, tanh, exp save their result) is shallow-copied without our state, so the backward
failed ("has no XLA data"): our kernel wraps results on the xla device, as PyTorch does
for XLA. A copy between xla tensors of one shape and dtype shares the source's value (no
IR op).

A write into a view whose view chain has an `as_strided` past its first view (e.g.
`torch.as_strided(x.detach(), ...)[i] = v`) is refused by PyTorch's functional storage
for every device but DeviceType::XLA (it calls as_strided non-compositional). The copy
kernel writes it through the view's autograd base instead: the positions the rest of the
chain reads are found by replaying it on an index tensor, and the base takes the values
there, so the view and its other aliases see the write as PyTorch/XLA's do. Other
in-place ops on such a view still meet PyTorch's refusal: their Functionalize kernels
are PyTorch's.
"""
from __future__ import annotations

import torch

from .. import patches
from ..tensor import make_tensor
from . import library

_FUNCTIONALIZE_SET = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
_VIEW_METAS = getattr(torch._C, "_functionalization", None)
# Views that only pick elements of their input (no value change, same dtype): replaying
# them on an index tensor finds the input positions a view reads.
_INDEX_VIEWS = frozenset(f"{n}_ViewMeta" for n in (
    "alias", "detach", "detach_", "lift_fresh", "as_strided", "as_strided_", "select_int", "slice_Tensor",
    "diagonal", "expand", "permute", "t", "t_", "transpose_int", "transpose_", "squeeze", "squeeze_",
    "squeeze_dim", "squeeze__dim", "squeeze_dims", "squeeze__dims", "unsqueeze", "unsqueeze_", "view",
    "_reshape_alias", "_unsafe_view", "unfold", "split_Tensor", "split_with_sizes", "unbind_int"))
_AS_STRIDED = frozenset({"as_strided_ViewMeta", "as_strided__ViewMeta"})
SCHEMA = "aten::copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)"


def _skip_functionalize():
    return torch._C._ExcludeDispatchKeyGuard(_FUNCTIONALIZE_SET)


def functionalize_copy_(self, src, non_blocking=False):
    if torch._is_functional_tensor(src):
        torch._sync(src)
        src_ = torch._from_functional_tensor(src)
    else:
        src_ = src
    if not torch._is_functional_tensor(self):
        with _skip_functionalize():
            if self.device.type != "xla" and src_.device.type == "xla":
                src_ = src_.to("cpu")
            self.copy_(src_, non_blocking)
        return self
    torch._sync(self)
    self_ = torch._from_functional_tensor(self)
    s = getattr(src_, "_xla", None)
    if s is not None and s.shape == tuple(self_.shape) and s.dtype == self_.dtype:
        # A whole-tensor copy of an xla value: the destination takes the same (immutable)
        # value, no op (the write-backs of compiled graphs are made of these).
        out = make_tensor(s.node, s.idx, s.shape, s.dtype)
    else:
        with _skip_functionalize():
            out = torch.ops.aten.copy.default(self_, src_, non_blocking)
    torch._functionalize_replace(self, out)
    try:
        torch._functionalize_commit_update(self)
    except RuntimeError:
        if not _write_through_base(self, out):
            raise
    torch._sync(self)
    return self


def _meta_names(t) -> list:
    return [type(m).__name__ for m in _VIEW_METAS.get_view_meta_sequence(t)]


def _write_through_base(view, value) -> bool:
    """Stores `value` (the new inner value of functional `view`) into the view's autograd
    base; False when the view is not one this can do (the caller re-raises PyTorch's error):
    its chain has no as_strided past the first view, it has no base, or a view taken
    from the base changes values or dtype."""
    if _VIEW_METAS is None:
        return False
    metas = _VIEW_METAS.get_view_meta_sequence(view)
    names = [type(m).__name__ for m in metas]
    base = view._base
    if not any(n in _AS_STRIDED for n in names[1:]) or base is None or not torch._is_functional_tensor(base):
        return False
    below = _meta_names(base)
    tail = metas[len(below):]
    if names[:len(below)] != below or any(n in _AS_STRIDED for n in below[1:]) \
            or not all(n in _INDEX_VIEWS for n in names[len(below):]):
        return False
    positions = _VIEW_METAS.apply_view_meta_sequence(torch.arange(base.numel()).reshape(base.shape), tail)
    if tuple(positions.shape) != tuple(value.shape):
        return False
    torch._sync(base)
    base_ = torch._from_functional_tensor(base)
    with _skip_functionalize():
        flat = base_.reshape(-1).index_put((positions.reshape(-1).to(base_.device),),
                                            value.reshape(-1).to(base_.dtype))
        new_base = flat.reshape(base_.shape)
    torch._functionalize_replace(base, new_base)
    torch._functionalize_commit_update(base)
    torch._sync(base)
    return True


def functionalize_to_copy(self, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                          memory_format=None):
    if torch._is_functional_tensor(self):
        torch._sync(self)
        self_ = torch._from_functional_tensor(self)
    else:
        self_ = self
    with _skip_functionalize():
        out = torch.ops.aten._to_copy.default(self_, dtype=dtype, layout=layout, device=device,
                                              pin_memory=pin_memory, non_blocking=non_blocking,
                                              memory_format=memory_format)
    if out.device.type != "xla" and not torch._C._dispatch_tls_is_dispatch_key_included(
            torch._C.DispatchKey.Functionalize):
        return out
    return torch._to_functional_tensor(out)


TO_COPY_SCHEMA = ("aten::_to_copy(Tensor self, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, "
                  "bool? pin_memory=None, bool non_blocking=False, MemoryFormat? memory_format=None) -> Tensor")


def _override(name: str, schema: str, kernel) -> bool:
    """Registers `kernel` as the Functionalize kernel of `aten::name` when the op has the
    schema it implements (another PyTorch's op is left alone, with a warning)."""
    got = str(getattr(torch.ops.aten, name).default._schema)
    if got != schema:
        return patches.refuse(f"the Functionalize kernel of aten::{name}", f"its schema is {got}")
    library.override(name, kernel, "Functionalize")
    return True


def install_copy() -> bool:
    """Patch `functionalize_copy`."""
    return _override("copy_", SCHEMA, functionalize_copy_)


def install_to_copy() -> bool:
    """Patch `functionalize_to_copy`."""
    return _override("_to_copy", TO_COPY_SCHEMA, functionalize_to_copy)
