"""Helpers shared by the FSDP wrappers: gradient checkpointing of a module, and a linear
layer whose backward saves the weight itself (not a transposed view of it), so a wrapper
can recognise and re-gather it."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...utils.checkpoint import checkpoint

__all__ = ["checkpoint_module", "XLAPatchedLinear", "xla_patched_nn_linear_forward", "apply_xla_patch_to_nn_linear"]


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Makes `module`'s forward gradient-checkpointed (in place; returns `module`).

    Its activations are recomputed in the backward (torch_xla.utils.checkpoint). Wrap
    with this before wrapping with an FSDP class."""
    orig = module.forward
    module._xla_checkpointed_forward_original = orig

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        if kwargs:
            return checkpoint(functools.partial(orig, **kwargs), *args, use_reentrant=True)
        return checkpoint(orig, *args, use_reentrant=True)

    module.forward = forward
    return module


class XLAPatchedLinear(torch.autograd.Function):
    """`F.linear` with a backward that saves `weight` itself (an einsum on both sides)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        ctx.save_for_backward(input, weight, bias)
        with torch.no_grad():
            return F.linear(input, weight, bias)

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


def apply_xla_patch_to_nn_linear(module: nn.Module) -> nn.Module:
    """Gives every nn.Linear in `module` the forward of `XLAPatchedLinear` (in place),
    except those whose forward was replaced already (e.g. by `checkpoint_module`)."""
    for m in module.modules():
        if type(m) is nn.Linear and "forward" not in m.__dict__:
            m._xla_patched_linear = True
            m.forward = functools.partial(xla_patched_nn_linear_forward, m)
    return module
