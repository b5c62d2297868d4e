"""The lowering table: aten overload name -> function of jax values.

One table serves every path: the lazy graph executor, eager mode, the dynamo
bridge and StableHLO export. A lowering receives the op's arguments in schema
order, with tensors replaced by `jax.Array`s (or tracers) and everything else as
the Python value, and returns a jax value (or a tuple/list of them for ops with
several outputs). The executor casts each result to the dtype PyTorch's meta
kernel predicted, so lowerings need not repeat PyTorch's type promotion.

Register with the decorator::

    @lowering("aten::add.Tensor", "aten::add.Scalar", promote=True)
    def add(x, y, alpha=1):
        return x + y * alpha if alpha != 1 else x + y

`promote=True` casts every array argument (tensors and scalar parameters) to the
op's common dtype first (PyTorch's elementwise type promotion).
`static=("end",)` names Scalar arguments whose value is part of the program
(e.g. they decide a shape) instead of a graph parameter.
"""
from __future__ import annotations

from .table import (LOWERINGS, Lowering, LoweringError, apply, check_range, check_whole, ctx, lowering, out_dtype,
                    out_shape, rng_key)

__all__ = ["LOWERINGS", "Lowering", "LoweringError", "apply", "check_range", "check_whole", "ctx", "lowering", "out_dtype",
           "out_shape", "rng_key", "load_all"]


def load_all() -> None:
    """Imports every lowering family (each registers itself)."""
    from . import (elementwise, reductions, selection, ctc, shape_ops, nn_ops, resampling, conv, pooling,  # noqa: F401
                   indexing, factories, custom, rnn, control_flow, linalg, random_ops, collectives, foreach, fft,
                   special, sharding, amp, composite, jax_call, quant, qdq)
