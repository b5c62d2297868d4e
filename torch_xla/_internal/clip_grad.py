"""`torch.nn.utils.clip_grad_norm_` whose zero norm is on the parameters' device.

With no gradient among the parameters, PyTorch returns `torch.tensor(0.0)` on the CPU;
for parameters on the xla device this returns that zero on their device, where the norm
is when they have gradients (PyTorch/XLA returns it there too). Everything else is
PyTorch's own function. `import torch_xla` installs it (patch registry entry
`clip_grad_norm`, `PT_XLA_PATCH_CLIP_GRAD_NORM=0` turns it off); the original stays as
`torch.nn.utils.clip_grad_norm_._orig`. It lives outside the engine so that TorchDynamo
traces it as it traces PyTorch's (the engine's files are skipped).
"""
from __future__ import annotations

import types

import torch
from torch.nn.utils import clip_grad as _clip_grad

from .._engine import patches

_ORIG = torch.nn.utils.clip_grad_norm_
_PARAMS = ["parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach"]


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    if not isinstance(parameters, torch.Tensor):
        given = parameters
        parameters = list(parameters)  # an iterator is read once, here
        if not parameters and isinstance(given, types.GeneratorType):
            parameters = given  # exhausted: PyTorch warns about an empty generator
    total = _ORIG(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if total.device.type != "xla":  # no gradient: PyTorch's CPU zero
        first = parameters if isinstance(parameters, torch.Tensor) else next(iter(parameters), None)
        if isinstance(first, torch.Tensor) and first.device.type == "xla":
            total = total.to(first.device)
    return total


clip_grad_norm_.__doc__ = _ORIG.__doc__
clip_grad_norm_._orig = _ORIG


def install() -> bool:
    """Patch `clip_grad_norm`: makes `torch.nn.utils.clip_grad_norm_` this function (if
    PyTorch's looks as expected)."""
    if not patches.signature_matches(_ORIG, _PARAMS, "torch.nn.utils.clip_grad_norm_"):
        return False
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    if getattr(_clip_grad, "clip_grad_norm_", None) is _ORIG:
        _clip_grad.clip_grad_norm_ = clip_grad_norm_
    return True
