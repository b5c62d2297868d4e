"""`torch_xla.amp.syncfree.Adam`."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import Tensor

from . import _functional as F
from ._base import SyncFree


class AdamRule(SyncFree):
    """The update of Adam and AdamW (decoupled weight decay when the optimizer's defaults
    say so, as torch.optim.AdamW's do)."""

    def _check_grad(self, p: Tensor) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")

    def _init_state(self, p: Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor],
                states: List[Dict[str, Any]], found_inf: Tensor) -> None:
        beta1, beta2 = group["betas"]
        F.adam_step(found_inf, [s["step"] for s in states], params, grads, [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states], [s.get("max_exp_avg_sq") for s in states],
                    amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                    use_adamw=bool(self.defaults.get("decoupled_weight_decay", False)))


class Adam(AdamRule, torch.optim.Adam):
    """torch.optim.Adam whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.Adam's step)."""
