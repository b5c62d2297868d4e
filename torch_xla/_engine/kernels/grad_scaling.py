"""Kernels of the gradient scaling ops (`_amp_foreach_non_finite_check_and_unscale`,
`_amp_update_scale`, functional and in-place): one IR node each, lowered in
`lowering/amp.py`, so GradScaler's checks never read the device."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import ir
from ..lowering import LOWERINGS
from ..tensor import make_tensor, replace_state, state_of
from .op_kernel import freeze


def _apply(name: str, inputs: Sequence[torch.Tensor], statics: tuple,
           avals: Sequence[Tuple[tuple, torch.dtype]]) -> List[torch.Tensor]:
    operands = []
    for t in inputs:
        if t.device.type != "xla":
            raise RuntimeError(f"{name}: expected all tensors on the xla device, got one on {t.device}")
        s = state_of(t)
        operands.append((s.node, s.idx))
    args = tuple(ir.ref(i) for i in range(len(operands))) + tuple(freeze(v) for v in statics)
    node = ir.Node(name, tuple(operands), args, tuple((tuple(sh), dt) for sh, dt in avals), LOWERINGS[name], None)
    return [make_tensor(node, i, tuple(sh), dt) for i, (sh, dt) in enumerate(avals)]


def _check(grads, found_inf, inv_scale):
    if inv_scale.numel() != 1:
        raise RuntimeError("inv_scale must be a 1-element tensor.")
    if found_inf.numel() != 1:
        raise RuntimeError("found_inf must be a 1-element tensor.")
    if inv_scale.dtype != torch.float32:
        raise RuntimeError("inv_scale must be a float tensor.")
    if found_inf.dtype != torch.float32:
        raise RuntimeError("found_inf must be a float tensor.")
    grads = list(grads)
    avals = [(tuple(g.shape), g.dtype) for g in grads] + [(tuple(found_inf.shape), found_inf.dtype)]
    return _apply("xla::amp_check_and_unscale", grads + [found_inf, inv_scale], (), avals)


def check_and_unscale_(grads, found_inf, inv_scale) -> None:
    """`_amp_foreach_non_finite_check_and_unscale_`."""
    outs = _check(grads, found_inf, inv_scale)
    for t, o in zip(list(grads) + [found_inf], outs):
        replace_state(t, o._xla)


def check_and_unscale(grads, found_inf, inv_scale):
    """`_amp_foreach_non_finite_check_and_unscale` (functional)."""
    outs = _check(grads, found_inf, inv_scale)
    return outs[:-1], outs[-1]


def _update(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if growth_tracker.dtype != torch.int32:
        raise RuntimeError("growth_tracker must be an int tensor.")
    if scale.dtype != torch.float32:
        raise RuntimeError("current_scale must be a float tensor.")
    if found_inf.dtype != torch.float32:
        raise RuntimeError("found_inf must be a float tensor.")
    avals = [(tuple(scale.shape), scale.dtype), (tuple(growth_tracker.shape), growth_tracker.dtype)]
    return _apply("xla::amp_update_scale", [scale, growth_tracker, found_inf],
                  (float(growth_factor), float(backoff_factor), int(growth_interval)), avals)


def update_scale_(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """`_amp_update_scale_`: updates scale and growth_tracker in place, returns scale."""
    s, g = _update(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)
    replace_state(scale, s._xla)
    replace_state(growth_tracker, g._xla)
    return scale


def update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    """`_amp_update_scale` (functional): (new scale, new growth_tracker)."""
    s, g = _update(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)
    return s, g


KERNELS = {
    "_amp_foreach_non_finite_check_and_unscale_": check_and_unscale_,
    "_amp_foreach_non_finite_check_and_unscale": check_and_unscale,
    "_amp_update_scale_": update_scale_,
    "_amp_update_scale": update_scale,
}
