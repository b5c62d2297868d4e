"""`prime_optimizer`: create an optimizer's state so a checkpoint can be loaded into it."""
from __future__ import annotations

import torch

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs

from ._helpers import is_xla_tensor, xla_sharding


def prime_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Runs one optimizer step with zero gradients (laid out like their parameters) so that
    the optimizer state exists; checkpoints load in place and need it.

    The step may change the parameters (weight decay): use it only right before
    restoring a checkpoint that overwrites them."""
    torch_xla.sync()
    xm.wait_device_ops()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or not p.requires_grad:
                continue
            p.grad = torch.zeros_like(p, requires_grad=False)
            if is_xla_tensor(p) and xla_sharding(p) is not None:
                xs.shard_as(p, p.grad)
    optimizer.step()
    torch_xla.sync()
    xm.wait_device_ops()
    return optimizer
