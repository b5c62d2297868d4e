"""Splat constants: a scalar constant at a full shape as one `stablehlo.constant`.

jax writes a scalar operand of a broadcasting op as a 0-d constant and a
`broadcast_in_dim`; exported StableHLO writes it as one constant of the op's shape
(`dense<1.0> : tensor<2x3xf32>`), which is what readers of exported programs match.
MLIR stores it as one value and XLA turns it back into a broadcast scalar, so the
compiled program is the same.
"""
from __future__ import annotations

import numpy as np

_PRIMITIVE = []


def _primitive():
    if _PRIMITIVE:
        return _PRIMITIVE[0]
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    from jax._src.core import ShapedArray
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    p = Primitive("xla_splat_constant")
    p.def_abstract_eval(lambda *, value, shape: ShapedArray(shape, np.dtype(value.dtype)))

    def lower(ctx, *, value, shape):
        out = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
        scalar = ir.DenseElementsAttr.get(np.asarray(value.value)).get_splat_value()
        return [hlo.constant(ir.DenseElementsAttr.get_splat(out, scalar))]

    mlir.register_lowering(p, lower)
    _PRIMITIVE.append(p)
    return p


class _Scalar:
    """A numpy scalar as a hashable primitive parameter (by dtype and bytes)."""
    __slots__ = ("value", "dtype")

    def __init__(self, value: np.ndarray):
        self.value = np.asarray(value)
        self.dtype = self.value.dtype

    def __hash__(self):
        return hash((self.dtype.str, self.value.tobytes()))

    def __eq__(self, other):
        return (isinstance(other, _Scalar) and self.dtype == other.dtype
                and self.value.tobytes() == other.value.tobytes())


def splat(value: np.ndarray, shape: tuple):
    """The 0-d host `value` as a constant of `shape`."""
    return _primitive().bind(value=_Scalar(value), shape=tuple(shape))
