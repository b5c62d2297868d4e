"""SPMD annotations inside a program: sharding constraints and manual regions."""
from __future__ import annotations

from jax import lax

from .table import lowering


@lowering("xla::sharding_constraint")
def sharding_constraint(x, sharding):
    """The value laid out with `sharding`: XLA's partitioner takes it from here."""
    return lax.with_sharding_constraint(x, sharding)
