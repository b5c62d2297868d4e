"""`torch_xla.amp.syncfree.SGD`."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import _functional as F
from ._base import grad_of, resolve


class SGD(torch.optim.SGD):
    """torch.optim.SGD whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.SGD's step)."""

    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, found_inf: Optional[Tensor] = None):
        found_inf, grad_scale = resolve(self, found_inf)
        if found_inf is None:
            return super().step(closure=closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs, steps = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                params.append(p)
                grads.append(grad_of(p, grad_scale))
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros_like(found_inf, device=p.device)
                steps.append(state["step"])
                bufs.append(state.get("momentum_buffer"))
            F.sgd_step(found_inf.to(params[0].device) if params else found_inf, steps, params, grads, bufs,
                       weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                       dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
            for p, buf in zip(params, bufs):
                if buf is not None:
                    self.state[p]["momentum_buffer"] = buf
        return loss
