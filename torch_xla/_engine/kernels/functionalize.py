"""The Functionalize kernel of `aten::copy_` (patch registry entry `functionalize_copy`).

`cpu.copy_(xla)` reaches functionalization with a plain destination and a functional
source: `load_state_dict` into a CPU model, and DDP's C++ code
(verify_params_across_processes, Reducer::sync_bucket_indices). PyTorch's kernel refuses
that for every device but DeviceType::XLA ("mutating a non-functional tensor with a
functional tensor is not allowed"); ours is PrivateUse1 named "xla". This kernel does what
PyTorch's does and, in that case, reads the source to the destination's device first. A
copy between xla tensors of one shape and dtype shares the source's value (no IR op).
"""
from __future__ import annotations

import torch

from ..tensor import make_tensor

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


def schema_matches() -> bool:
    return str(torch.ops.aten.copy_.default._schema) == SCHEMA
