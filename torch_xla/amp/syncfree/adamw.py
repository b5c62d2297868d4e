"""`torch_xla.amp.syncfree.AdamW`."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ._base import resolve
from .adam import adam_like_step


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.AdamW's step)."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, found_inf: Optional[Tensor] = None):
        found_inf, grad_scale = resolve(self, found_inf)
        if found_inf is None:
            return super().step(closure=closure)
        return adam_like_step(self, closure, found_inf, grad_scale, use_adamw=True)
