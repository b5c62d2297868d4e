"""`torch_xla.utils.checkpoint`: activation checkpointing that XLA does not undo.

The forward runs without saving activations; the backward runs it again. In one lazy
graph XLA would merge the recomputation with the original forward (common-subexpression
elimination) and keep every activation alive anyway, so the recomputation starts from
inputs (with the incoming gradients and, for a module's forward, its parameters and
buffers) that went through `xm.optimization_barrier_`. Random ops replay the numbers of
the original forward (CPU generator and the device generator's position).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, List, Tuple

import torch
import torch.utils.checkpoint as _tc

from .._engine import comm as _coll, rng as _rng

__all__ = ["checkpoint", "checkpoint_sequential", "CheckpointFunction"]


def _detach_inputs(inputs: Iterable[Any]) -> Tuple[Any, ...]:
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            y = x.detach()
            y.requires_grad_(x.requires_grad)
            out.append(y)
        else:
            out.append(x)
    return tuple(out)


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint: forward under no_grad, recompute and backprop in backward."""

    @staticmethod
    def forward(ctx, run_function: Callable, preserve_rng_state: bool, *args):
        ctx.run_function = run_function
        ctx.preserve_rng_state = preserve_rng_state
        if preserve_rng_state:
            ctx.fwd_cpu_state = torch.get_rng_state()
            ctx.fwd_xla_state = _rng.snapshot()
        ctx.inputs, tensor_idx, tensors = [], [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensor_idx.append(i)
                tensors.append(a)
                ctx.inputs.append(None)
            else:
                ctx.inputs.append(a)
        ctx.tensor_idx = tensor_idx
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad() or when an `inputs` parameter is "
                               "passed to .backward(). Please use .backward() and do not pass its `inputs` argument.")
        inputs = list(ctx.inputs)
        for i, t in zip(ctx.tensor_idx, ctx.saved_tensors):
            inputs[i] = t
        detached = _detach_inputs(inputs)
        # Behind one barrier: the inputs, the incoming gradients and, for a module's
        # forward, its parameters and buffers, so nothing of the recomputation can be
        # merged with the original forward.
        held = list(detached) + list(grads)
        owner = getattr(ctx.run_function, "__self__", None)
        if inspect.ismethod(ctx.run_function) and isinstance(owner, torch.nn.Module):
            held += list(owner.parameters()) + list(owner.buffers())
        _coll.optimization_barrier_([x for x in held if isinstance(x, torch.Tensor)])
        cpu_state, xla_state = torch.get_rng_state(), _rng.snapshot()
        try:
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.fwd_cpu_state)
                _rng.restore(ctx.fwd_xla_state)
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            if ctx.preserve_rng_state:
                torch.set_rng_state(cpu_state)
                _rng.restore(xla_state)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        outs, out_grads = [], []
        for o, g in zip(outputs, grads):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                outs.append(o)
                out_grads.append(g)
        if not outs:
            raise RuntimeError("none of output has requires_grad=True, this checkpoint() is not necessary")
        torch.autograd.backward(outs, out_grads)
        return (None, None) + tuple(x.grad if isinstance(x, torch.Tensor) else None for x in detached)


def checkpoint(function: Callable, *args, use_reentrant: bool = True, **kwargs):
    """Checkpoints `function(*args)`: its activations are recomputed in the backward.

    use_reentrant=True (the default, as in PyTorch/XLA) recomputes behind an optimization
    barrier; False uses PyTorch's non-reentrant checkpoint (keyword arguments allowed)."""
    preserve = kwargs.pop("preserve_rng_state", True)
    if use_reentrant:
        if kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        return CheckpointFunction.apply(function, preserve, *args)
    return _tc.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve, **kwargs)


def checkpoint_sequential(functions, segments: int, input, use_reentrant: bool = True, **kwargs):
    """Splits a sequential model in `segments` and checkpoints each but the last."""
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions: List = list(functions)

    def run(start, end):
        def forward(x):
            for j in range(start, end + 1):
                x = functions[j](x)
            return x
        return forward

    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(run(start, end), input, use_reentrant=use_reentrant, preserve_rng_state=preserve)
    return run(end + 1, len(functions) - 1)(input)
