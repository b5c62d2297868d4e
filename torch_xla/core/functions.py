"""Differentiable collectives and layers built on them (`torch_xla.core.functions`).

Their gradients assume what follows the collective is computed alike on every replica
(as in `distributed_mm` and data-parallel training): the backward of `all_gather` keeps
this replica's slice of the incoming gradient, that of a sum `all_reduce` passes it on.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import runtime as xr
from . import xla_model as xm


class AllReduce(torch.autograd.Function):
    """`xm.all_reduce` with a gradient (sum, mul, min, max)."""

    @staticmethod
    def forward(ctx, input, reduce_type, scale, groups):
        ctx.reduce_type = reduce_type
        ctx.scale = scale
        output = xm.all_reduce(reduce_type, input, scale=scale, groups=groups)
        ctx.save_for_backward(input, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, output = ctx.saved_tensors
        grad = grad_output * ctx.scale if ctx.scale != 1.0 else grad_output
        if ctx.reduce_type == xm.REDUCE_SUM:
            return grad, None, None, None
        if ctx.reduce_type == xm.REDUCE_MUL:
            # d(prod)/d(x) = prod / x where x != 0.
            return grad * torch.where(input != 0, output / input, torch.zeros_like(input)), None, None, None
        if ctx.reduce_type in (xm.REDUCE_MIN, xm.REDUCE_MAX):
            return torch.where(input == output, grad, torch.zeros_like(grad)), None, None, None
        raise RuntimeError(f'Unsupported reduce type: {ctx.reduce_type}')


def all_reduce(reduce_type: str, value: torch.Tensor, scale: float = 1.0,
               groups: Optional[List[List[int]]] = None) -> torch.Tensor:
    """`xm.all_reduce(reduce_type, value, scale, groups)` that autograd differentiates."""
    return AllReduce.apply(value, reduce_type, scale, groups)


class AllGather(torch.autograd.Function):
    """`xm.all_gather` with a gradient: this replica's slice of the output's gradient."""

    @staticmethod
    def forward(ctx, input, dim):
        ctx.dim = dim
        ctx.ordinal = xr.global_ordinal()
        ctx.world_size = xr.world_size()
        return xm.all_gather(input, dim=dim)

    @staticmethod
    def backward(ctx, grad_output):
        size = grad_output.size(ctx.dim) // ctx.world_size
        return torch.narrow(grad_output.clone(), ctx.dim, ctx.ordinal * size, size), None


def all_gather(value: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`xm.all_gather(value, dim)` that autograd differentiates."""
    return AllGather.apply(value, dim)


def distributed_mm(w: torch.Tensor, x: torch.Tensor, split: int = 1) -> torch.Tensor:
    """`W @ x` where each replica holds its `N x Ko` column block `w` of `W` and the whole
    `x` (`Ko * world_size x M`); `split` cuts `M` in that many pieces (one all-gather each).
    """
    ordinal, world = xr.global_ordinal(), xr.world_size()
    if x.size(0) // world != w.size(1):
        raise ValueError(f"distributed_mm: x has {x.size(0)} rows, expected {w.size(1)} x {world} replicas")
    if split != 1:
        if x.size(1) % split:
            raise ValueError(f"distributed_mm: {x.size(1)} columns do not split in {split}")
        pieces = torch.split(x, x.size(1) // split, dim=1)
    else:
        pieces = [x]
    results = []
    for xs in pieces:
        xg = all_gather(xs, dim=1)                                  # WG x (M * world)
        xgn = torch.narrow(xg, 0, ordinal * w.size(1), w.size(1))   # Ko x (M * world)
        total = all_reduce(xm.REDUCE_SUM, w @ xgn)                  # N x (M * world)
        results.append(torch.narrow(total, 1, ordinal * xs.size(1), xs.size(1)))
    return torch.cat(results, dim=1) if len(results) > 1 else results[0]


class AllReduceSumLayer(torch.autograd.Function):
    """A sum all-reduce whose gradient is the sum all-reduce of the output's gradient."""

    @staticmethod
    def forward(ctx, x):  # noqa: ARG004 (autograd.Function's signature)
        return xm.all_reduce(xm.REDUCE_SUM, x)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ARG004 (autograd.Function's signature)
        return xm.all_reduce(xm.REDUCE_SUM, grad_output)


class SyncBatchNorm(torch.nn.Module):
    """Batch normalization over the batches of every replica (inputs of 2 to 5 dims,
    channels in dim 1). Training statistics are all-reduced; running statistics follow
    `torch.nn.BatchNorm*d` (unbiased running variance)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = torch.nn.Parameter(torch.ones(num_features))
        self.bias = torch.nn.Parameter(torch.zeros(num_features))
        self.register_buffer('running_mean', torch.zeros(num_features))
        self.register_buffer('running_var', torch.ones(num_features))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if not (2 <= batch.ndim <= 5) or batch.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) expects (N, {self.num_features}, ...) "
                             f"inputs of 2 to 5 dimensions, got {tuple(batch.shape)}")
        dims = [d for d in range(batch.ndim) if d != 1]
        if self.training:
            world = xr.world_size()
            mean = AllReduceSumLayer.apply(torch.mean(batch, dim=dims)) / world
            sqr_mean = AllReduceSumLayer.apply(torch.mean(batch * batch, dim=dims)) / world
            var = sqr_mean - mean.pow(2)
            n = world * batch.numel() // batch.shape[1]
            with torch.no_grad():
                unbiased = var.detach() * (n / max(n - 1, 1))
                self.running_mean.mul_(1 - self.momentum).add_(mean.detach(), alpha=self.momentum)
                self.running_var.mul_(1 - self.momentum).add_(unbiased, alpha=self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        shape = [1, self.num_features] + [1] * (batch.ndim - 2)
        inv = torch.rsqrt(var + self.eps).reshape(shape)
        return (batch - mean.reshape(shape)) * inv * self.weight.reshape(shape) + self.bias.reshape(shape)

    def extra_repr(self) -> str:
        return f'{self.num_features}, eps={self.eps}'
