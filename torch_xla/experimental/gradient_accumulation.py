"""`gradient_accumulation`: accumulate gradients over the leading dimension of inputs.

PyTorch/XLA builds one XLA While loop; here the loop is traced into the step's graph
(one iteration per slice), with the same results: gradients summed into `.grad` of the
model's parameters (only theirs: other tensors the loss depends on get none, as the
original's loop returns the model's gradients only), the losses (each divided by the
number of steps) summed.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple, Union

import torch

__all__ = ["gradient_accumulation"]


def gradient_accumulation(train_step: Callable[..., Any], iterable_tensors: Tuple[torch.Tensor, ...],
                          model: torch.nn.Module, *carried_tensors: torch.Tensor
                          ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """Runs `train_step(*slices, *carried)` for each index of the leading dimension of
    `iterable_tensors`, back-propagating `loss / steps` each time into the `.grad` of
    `model`'s parameters (those that require it).

    train_step returns the loss, or (loss, *new_carried) when carried tensors are given; it
    must not modify its inputs in place (AssertionError, as PyTorch/XLA's check).
    Returns the accumulated loss, followed by the final carried tensors if any."""
    if not iterable_tensors:
        raise ValueError("iterable_tensors cannot be empty")
    steps = iterable_tensors[0].size(0)
    for i, t in enumerate(iterable_tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Element {i} of iterable_tensors is not a tensor")
        if t.numel() == 0:
            raise ValueError(f"Element {i} of iterable_tensors is empty")
        if t.size(0) != steps:
            raise ValueError(f"Element {i} of iterable_tensors has inconsistent first dimension")
    params = [p for p in model.parameters() if p.requires_grad]
    carried = tuple(carried_tensors)
    total = None
    for i in range(steps):
        inputs = tuple(iterable_tensors) + carried
        versions = [t._version for t in inputs]
        result = train_step(*(t[i] for t in iterable_tensors), *carried)
        if [t._version for t in inputs] != versions:
            raise AssertionError("gradient_accumulation: train_step mutated one of its input tensors in place; "
                                 "it must be pure (return new carried tensors instead)")
        if carried:
            loss, *rest = result
            if len(rest) != len(carried):
                raise ValueError(f"train_step returned {len(rest)} carried tensors, expected {len(carried)}")
            carried = tuple(rest)
        else:
            loss = result
        loss = loss / steps
        if params:
            loss.backward(inputs=params)
        elif not loss.requires_grad:
            loss.backward()  # PyTorch's error: nothing to differentiate
        total = loss.detach() if total is None else total + loss.detach()
    return (total, *carried) if carried else total
