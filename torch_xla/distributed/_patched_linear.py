"""`nn.Linear` as einsums, forward and backward (shared by SPMD and FSDP).

The forward keeps a 3-d activation 3-d (a matmul would flatten it to 2-d and lose its
sharding annotation under SPMD); the backward saves the weight itself, not a transposed
view of it, so an FSDP wrapper can recognise and re-gather it."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["XLAPatchedLinear", "xla_patched_nn_linear_forward", "apply_xla_patch_to_nn_linear"]


class XLAPatchedLinear(torch.autograd.Function):
    """`F.linear` computed with einsums on both sides."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        ctx.save_for_backward(input, weight, bias)
        out = torch.einsum("...n,kn->...k", input, weight)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        gi = gw = gb = None
        if ctx.needs_input_grad[0]:
            gi = torch.einsum("...n,nk->...k", grad_output, weight)
        if ctx.needs_input_grad[1]:
            gw = torch.einsum("...n,...k->nk", grad_output, input)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
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
