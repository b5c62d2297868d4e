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
"""
from __future__ import annotations

import torch

from .. import patches
from ..tensor import make_tensor
from . import library

_FUNCTIONALIZE_SET = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
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
    torch._functionalize_commit_update(self)
    torch._sync(self)
    return self


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
