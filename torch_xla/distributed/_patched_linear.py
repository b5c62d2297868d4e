"""`nn.Linear` as dot products, forward and backward (shared by SPMD and FSDP).

The forward keeps a 3-d activation 3-d: one XLA dot with no reshape (a matmul or an
einsum would flatten it to 2-d and lose its sharding annotation under SPMD); the backward saves the weight itself, not a transposed
view of it, so an FSDP wrapper can recognise and re-gather it."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["XLAPatchedLinear", "xla_patched_nn_linear_forward", "apply_xla_patch_to_nn_linear"]


def _contract(a: torch.Tensor, b: torch.Tensor, da, db) -> torch.Tensor:
    """a and b contracted over dims da of a and db of b: on the device one XLA dot with
    no reshape (`torch.ops.xla.dot_general`), elsewhere torch.tensordot."""
    if a.device.type == "xla" and b.device.type == "xla":
        return torch.ops.xla.dot_general(a, b, list(da), list(db))
    return torch.tensordot(a, b, dims=(list(da), list(db)))


class XLAPatchedLinear(torch.autograd.Function):
    """`F.linear` as one dot product on each side, whatever the input's rank. Under
    autocast the inputs are cast to the autocast dtype first (as a custom_fwd does)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        if input.device.type == "xla" and torch.is_autocast_enabled("xla"):
            dt = torch.get_autocast_dtype("xla")
            input, weight = input.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
        ctx.save_for_backward(input, weight, bias)
        out = _contract(input, weight, [input.dim() - 1], [1])
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_output = grad_output.to(weight.dtype)
        lead = list(range(grad_output.dim() - 1))
        gi = gw = gb = None
        if ctx.needs_input_grad[0]:
            gi = _contract(grad_output, weight, [grad_output.dim() - 1], [0])
        if ctx.needs_input_grad[1]:
            gw = _contract(grad_output, input, lead, lead)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = grad_output.sum(lead) if lead else grad_output
        return gi, gw, gb


def xla_patched_nn_linear_forward(m: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


def apply_xla_patch_to_nn_linear(module: nn.Module, patched_function=xla_patched_nn_linear_forward) -> nn.Module:
    """Gives every nn.Linear in `module` the forward `patched_function(linear, input)`
    (default: `XLAPatchedLinear`'s), in place, except those whose forward was replaced
    already (e.g. by `checkpoint_module`)."""
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m._xla_patched_linear = True
            m.forward = functools.partial(patched_function, m)
    return module
