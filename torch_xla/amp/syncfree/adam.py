"""`torch_xla.amp.syncfree.Adam`."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import _functional as F
from ._base import grad_of, resolve


def adam_like_step(opt: torch.optim.Optimizer, closure: Optional[Callable], found_inf: Tensor,
                   grad_scale: Optional[Tensor], use_adamw: bool):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in opt.param_groups:
        params, grads, avgs, sqs, maxs, steps = [], [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
            params.append(p)
            grads.append(grad_of(p, grad_scale))
            state = opt.state[p]
            if "step" not in state:
                state["step"] = torch.zeros_like(found_inf, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
            maxs.append(state.get("max_exp_avg_sq"))
            steps.append(state["step"])
        if not params:
            continue
        beta1, beta2 = group["betas"]
        F.adam_step(found_inf.to(params[0].device), steps, params, grads, avgs, sqs, maxs,
                    amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                    use_adamw=use_adamw)
    return loss


class Adam(torch.optim.Adam):
    """torch.optim.Adam whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.Adam's step)."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, found_inf: Optional[Tensor] = None):
        found_inf, grad_scale = resolve(self, found_inf)
        if found_inf is None:
            return super().step(closure=closure)
        return adam_like_step(self, closure, found_inf, grad_scale,
                              use_adamw=bool(self.defaults.get("decoupled_weight_decay", False)))
