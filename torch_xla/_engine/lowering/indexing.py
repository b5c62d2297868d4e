"""indexing lowerings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import lowering, out_dtype, out_shape
