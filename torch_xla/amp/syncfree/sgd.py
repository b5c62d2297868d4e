"""`torch_xla.amp.syncfree.SGD`."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import Tensor

from . import _functional as F
from ._base import SyncFree


class SGD(SyncFree, torch.optim.SGD):
    """torch.optim.SGD whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.SGD's step)."""

    def _update(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor],
                states: List[Dict[str, Any]], found_inf: Tensor) -> None:
        bufs = [s.get("momentum_buffer") for s in states]
        F.sgd_step(found_inf, [s["step"] for s in states], params, grads, bufs,
                   weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
        for state, buf in zip(states, bufs):
            if buf is not None:
                state["momentum_buffer"] = buf
