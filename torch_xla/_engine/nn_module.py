"""Keeps tied parameters tied when a module moves to the xla device.

`Module._apply` gives each module its own new Parameter when the old one cannot
take the new data in place, which is the case from CPU to xla (different tensor
types). Two modules that shared one Parameter (an embedding tied to an LM head)
would then train two copies. This wrapper restores the sharing afterwards.
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


def install() -> None:
    if torch.nn.Module._apply is not _apply:
        torch.nn.Module._apply = _apply
