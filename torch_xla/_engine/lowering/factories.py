"""Factory ops: constants, full, arange, eye, linspace (and the engine's broadcast)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from .table import lowering, out_dtype, out_shape


@lowering("xla::broadcast")
def broadcast(x, shape):
    return jnp.broadcast_to(x, shape)


@lowering("aten::full")
def full(size, value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), value, out_dtype())


@lowering("aten::zeros", "aten::_efficientzerotensor")
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), out_dtype())


@lowering("aten::ones")
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), out_dtype())


@lowering("aten::scalar_tensor")
def scalar_tensor(value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(value, out_dtype())


def _meta_arange(*pos, **kwargs):
    # The CPU checks the bounds are finite before the step's sign (PyTorch's meta kernel
    # checks the sign first, with another message).
    start, end = (0, pos[0]) if len(pos) == 1 else pos[:2]
    if not (math.isfinite(start) and math.isfinite(end)):
        raise RuntimeError(f"unsupported range: {start:g} -> {end:g}")
    overload = ("default", "start", "start_step")[len(pos) - 1]
    return getattr(torch.ops.aten.arange, overload)(*pos, **kwargs)


@lowering("aten::arange", "aten::arange.start", "aten::arange.start_step", static=("start", "end", "step"),
          meta=_meta_arange)
def arange(*args, **kwargs):
    # Output length is already known from the meta kernel: arange = start + i * step.
    n = out_shape()[0]
    nums = [a for a in args if isinstance(a, (int, float, np.number)) and not isinstance(a, bool)]
    if len(nums) == 1:
        start, step = 0, 1
    elif len(nums) == 2:
        start, step = nums[0], 1
    else:
        start, step = nums[0], nums[2]
    dt = out_dtype()
    if jnp.issubdtype(dt, jnp.integer):
        return (start + jnp.arange(n, dtype=jnp.int64) * step).astype(dt)
    return (start + jnp.arange(n, dtype=jnp.float64) * step).astype(dt)


@lowering("aten::eye", "aten::eye.m")
def eye(n, m=None, dtype=None, layout=None, device=None, pin_memory=None):
    shape = out_shape()
    return jnp.eye(shape[0], shape[1], dtype=out_dtype())


@lowering("aten::linspace", static=("start", "end"))
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.linspace(start, end, steps, dtype=jnp.float64).astype(out_dtype())
