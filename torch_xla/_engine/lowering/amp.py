"""Gradient scaling ops of automatic mixed precision (what `torch.amp.GradScaler` calls).

Both run on the device: the inf/NaN check folds into `found_inf` and the scale update
selects with `where`, so a training step never reads a value back to the host. The
kernels (`kernels/grad_scaling.py`) pass tensor lists flat.
"""
from __future__ import annotations

import jax.numpy as jnp

from .table import lowering


@lowering("xla::amp_check_and_unscale")
def check_and_unscale(*args):
    """args: grads..., found_inf, inv_scale -> grads * inv_scale..., found_inf (1 if any
    grad holds an inf or a NaN, else unchanged)."""
    *grads, found_inf, inv_scale = args
    bad = jnp.zeros((), jnp.bool_)
    outs = []
    for g in grads:
        bad = bad | ~jnp.all(jnp.isfinite(g))
        outs.append((g.astype(jnp.float32) * inv_scale.astype(jnp.float32)).astype(g.dtype))
    return tuple(outs) + (jnp.where(bad, jnp.ones_like(found_inf), found_inf),)


@lowering("xla::amp_update_scale")
def update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """PyTorch's rule: on inf back off and reset the tracker; grow the scale after
    `growth_interval` clean steps in a row."""
    inf = found_inf.astype(jnp.float32) > 0
    grown = growth_tracker + 1
    grow = grown >= growth_interval
    new_scale = jnp.where(inf, scale * backoff_factor, jnp.where(grow, scale * growth_factor, scale))
    new_tracker = jnp.where(inf | grow, jnp.zeros_like(growth_tracker), grown)
    return new_scale.astype(scale.dtype), new_tracker.astype(growth_tracker.dtype)
