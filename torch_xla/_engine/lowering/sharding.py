"""SPMD annotations inside a program: sharding constraints and manual regions."""
from __future__ import annotations

from jax import lax

from .table import lowering


@lowering("xla::sharding_constraint")
def sharding_constraint(x, sharding):
    """The value laid out with `sharding`: XLA's partitioner takes it from here."""
    return lax.with_sharding_constraint(x, sharding)


@lowering("xla::full_to_shard", "xla::manual", "xla::shard_to_full")
def manual_region_edge(x, *args):
    """Edges of a manual region are lowered with the region, as one `shard_map`
    (`executor/manual.py`); reaching one alone means a per-device value left its region."""
    from .table import LoweringError
    raise LoweringError("a per-device value (inside a manual sharding region) can only leave the region "
                        "through disable_manual_sharding / _spmd_shard_to_full_shape")
