"""Helpers shared by the FSDP wrappers: gradient checkpointing of a module, and (from
`distributed/_patched_linear.py`) a linear layer whose backward saves the weight itself
(not a transposed view of it), so a wrapper can recognise and re-gather it."""
from __future__ import annotations

import functools

import torch.nn as nn

from ...utils.checkpoint import checkpoint
from .._patched_linear import XLAPatchedLinear, apply_xla_patch_to_nn_linear, xla_patched_nn_linear_forward  # noqa: F401

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
