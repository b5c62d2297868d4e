"""Loops on the device: PyTorch's `while_loop` on xla tensors, and `fori_loop`.

`torch._higher_order_ops.while_loop.while_loop(cond_fn, body_fn, carried_inputs)` on xla
tensors is one XLA `while` (`lax.while_loop`): the condition is a device tensor, read by
the loop on the device, not by a host loop. `cond_fn` and `body_fn` are traced once on
placeholders of the carried values (`_engine/subgraph.py`). `import torch_xla` registers
the kernel (patch registry entry `xla_while_loop`); it affects xla tensors only.

PyTorch's `while_loop` has no gradient; neither does this one.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from .._engine import patches, subgraph


def fori_loop(lower, upper, body_fun: Callable, *input_value) -> Tuple:
    """Runs `body_fun(*values) -> values` `upper - lower` times on the device.

    `lower` and `upper` are integers or 0-d integer tensors. Returns `(iterations left
    (zero), *values)`, as PyTorch/XLA's `fori_loop` does."""
    from torch._higher_order_ops.while_loop import while_loop
    device = next((v.device for v in input_value if isinstance(v, torch.Tensor)), torch.device("xla"))
    count = upper - lower
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(int(count), device=device)

    def cond_fn(i, *_values):
        return i > 0

    def body_fn(i, *values):
        out = body_fun(*values)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return (i - 1,) + out

    return while_loop(cond_fn, body_fn, (count,) + tuple(input_value))


def _avals(values: Sequence[torch.Tensor]) -> list:
    return [(tuple(v.shape), v.dtype) for v in values]


def _xla_while_loop(cond_fn, body_fn, carried_inputs, additional_inputs=None, **_options):
    """The PrivateUse1 kernel of `while_loop_op` (tensors below functionalization)."""
    carried = list(carried_inputs)
    additional = list(additional_inputs or ())
    for v in carried:
        if not isinstance(v, torch.Tensor):
            raise RuntimeError(f"while_loop on xla tensors: carried inputs must be tensors, got {type(v).__name__}")
    # Loop-invariant Python numbers (sizes Dynamo lifted) are passed to the functions as they are.
    static = {k: v for k, v in enumerate(additional) if not isinstance(v, torch.Tensor)}
    additional_t = [v for v in additional if isinstance(v, torch.Tensor)]
    avals = _avals(carried) + _avals(additional_t)

    def build_args(ph):
        it = iter(ph[len(carried):])
        return tuple(ph[:len(carried)]) + tuple(static[k] if k in static else next(it) for k in range(len(additional)))

    cond = subgraph.trace(cond_fn, avals, seeded=False, wrap=False, build_args=build_args)
    body = subgraph.trace(body_fn, avals, seeded=False, wrap=False, build_args=build_args)
    if len(cond.out_avals) != 1 or cond.out_avals[0][1] != torch.bool or cond.out_avals[0][0] not in ((), (1,)):
        raise RuntimeError(f"cond_fn must return a boolean scalar tensor, got {cond.out_avals}")
    want = _avals(carried)
    if body.out_avals != want or any(type(k) is not int for k in body.out_kinds):
        raise RuntimeError(f"body_fn must return tensors of the carried inputs' shapes and dtypes: expected {want}, "
                           f"got {body.out_avals}")
    spec = subgraph.Spec([cond, body], n_carry=len(carried), n_additional=len(additional_t))
    extra = subgraph.outer_operands(cond) + subgraph.outer_operands(body)
    return tuple(subgraph.apply("xla::while_loop", carried + additional_t, extra, spec, want, wrap=False))


def install() -> bool:
    """Patch `xla_while_loop`: the PrivateUse1 kernel of PyTorch's `while_loop` op."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.while_loop import while_loop_op
    if DispatchKey.PrivateUse1 in while_loop_op.py_kernels:
        return patches.refuse("xla_while_loop", "while_loop_op already has a PrivateUse1 kernel")
    while_loop_op.py_impl(DispatchKey.PrivateUse1)(_xla_while_loop)
    return True
