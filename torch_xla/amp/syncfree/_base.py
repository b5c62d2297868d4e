"""What the sync-free optimizers share: where `found_inf` comes from."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def resolve(opt: torch.optim.Optimizer, found_inf: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(found_inf, grad_scale): the `found_inf` argument, else the one a
    `torch.amp.GradScaler` attached (`_step_supports_amp_scaling`) with the scale the
    gradients still carry (None once `unscale_` ran)."""
    if found_inf is None:
        found_inf = getattr(opt, "found_inf", None)
        grad_scale = getattr(opt, "grad_scale", None)
    else:
        grad_scale = None
    if found_inf is not None and found_inf.dim() != 0:
        raise ValueError("The found_inf tensor has to be scalar type")
    return found_inf, grad_scale


def grad_of(p: Tensor, grad_scale: Optional[Tensor]) -> Tensor:
    if grad_scale is None:
        return p.grad
    return p.grad * grad_scale.to(p.grad.device).reciprocal().to(p.grad.dtype)
