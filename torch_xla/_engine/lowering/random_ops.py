"""random_ops lowerings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import lowering, out_dtype, out_shape


def _shape_dtype():
    return out_shape(), out_dtype()


@lowering("aten::uniform", random=True)
def uniform(x, lo=0.0, hi=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return jax.random.uniform(key, shape, jnp.float32, lo, hi).astype(dt)


@lowering("aten::normal_functional", random=True)
def normal(x, mean=0.0, std=1.0, generator=None, key=None):
    shape, dt = _shape_dtype()
    return (mean + std * jax.random.normal(key, shape, jnp.float32)).astype(dt)
