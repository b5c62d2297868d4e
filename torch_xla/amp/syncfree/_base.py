"""What the sync-free optimizers share: where `found_inf` comes from and the step around
each optimizer's update rule."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

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


class SyncFree:
    """Mixed in before a torch.optim class: `step(found_inf=t)` runs the subclass's
    `_update` on each group's parameters that have a gradient, skipped inside the graph
    where the device scalar `t` is non-zero; without a `found_inf` (given or attached by a
    GradScaler) the torch.optim class's own step runs."""

    _step_supports_amp_scaling = True

    def _check_grad(self, p: Tensor) -> None:
        """Raises what the torch.optim class raises for p's gradient."""

    def _init_state(self, p: Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        """p's state beyond its step count, made at p's first step."""

    def _update(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor],
                states: List[Dict[str, Any]], found_inf: Tensor) -> None:
        raise NotImplementedError

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
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads, states = [], []
            for p in params:
                self._check_grad(p)
                state = self.state[p]
                if "step" not in state:
                    # on the device, as the update rules count steps there
                    state["step"] = torch.zeros_like(found_inf, device=p.device)
                    self._init_state(p, state, group)
                grads.append(grad_of(p, grad_scale))
                states.append(state)
            self._update(group, params, grads, states, found_inf.to(params[0].device))
        return loss
