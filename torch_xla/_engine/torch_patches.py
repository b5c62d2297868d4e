"""The two places where PyTorch's own Python needs help with xla tensors.

- `Module._apply` gives each module its own new Parameter when the old one cannot
  take the new data in place, which is the case from CPU to xla (different tensor
  types). Two modules that shared one Parameter (an embedding tied to an LM head)
  would then train two copies: the wrapper restores the sharing afterwards.
- `cpu_tensor.copy_(xla_tensor)` (what `cpu_model.load_state_dict(xla_state_dict)`
  does) reaches functionalization with a plain destination and a functional source,
  which it refuses: the source is read to the CPU first.
"""
from __future__ import annotations

import threading

import torch

_orig_apply = torch.nn.Module._apply
_tls = threading.local()


def _apply(self, fn, recurse=True):
    if getattr(_tls, "active", False) or not recurse:
        return _orig_apply(self, fn, recurse)
    holders = {}
    for mod in self.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, name))
    _tls.active = True
    try:
        out = _orig_apply(self, fn, recurse)
    finally:
        _tls.active = False
    for refs in holders.values():
        if len(refs) < 2:
            continue
        mod0, name0 = refs[0]
        first = mod0._parameters[name0]
        if first is None or first.device.type != "xla":
            continue
        for mod, name in refs[1:]:
            if mod._parameters[name] is not first:
                mod._parameters[name] = first
    return out


_orig_copy_ = torch.Tensor.copy_


def _copy_(self, src, non_blocking=False):
    if (isinstance(src, torch.Tensor) and src.device.type == "xla" and self.device.type != "xla"
            and not torch._is_functional_tensor(self)):
        src = src.to(self.device)
    return _orig_copy_(self, src, non_blocking)


_copy_.__doc__ = _orig_copy_.__doc__


def install() -> None:
    if torch.nn.Module._apply is not _apply:
        torch.nn.Module._apply = _apply
    if torch.Tensor.copy_ is not _copy_:
        torch.Tensor.copy_ = _copy_
