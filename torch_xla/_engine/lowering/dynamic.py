"""Implicit broadcasting of values with unbounded (`?`) sizes, as StableHLO writes it.

A size declared dynamic (`_XLAC._xla_mark_dynamic`) is a jax symbolic dimension; two
such sizes are unrelated, so jax's own broadcasting cannot combine them. Elementwise ops
first bring every operand to the result's shape with `stablehlo.dynamic_broadcast_in_dim`
(the shape computed at run time as a tensor of i32), as XLA's unbounded-dynamism
broadcasting rules do: a static size other than 1 wins, else the dynamic ones (their
maximum when several), else 1.
"""
from __future__ import annotations

from typing import Sequence

_PRIMITIVE = []


def _primitive():
    if _PRIMITIVE:
        return _PRIMITIVE[0]
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    from jax._src.core import ShapedArray
    from jax._src.interpreters import mlir as jax_mlir   # the run-time shape as a tensor
    from jax._src.lib.mlir.dialects import hlo

    p = Primitive("xla_dynamic_broadcast")
    p.def_abstract_eval(lambda x, *, shape, dims: ShapedArray(shape, x.dtype))

    def lower(ctx, x, *, shape, dims):
        out = ctx.avals_out[0]
        sizes = jax_mlir.eval_dynamic_shape_as_tensor(ctx, out.shape)
        return [hlo.dynamic_broadcast_in_dim(mlir.aval_to_ir_type(ctx.module_context, out), x, sizes, mlir.dense_int_array(dims))]

    mlir.register_lowering(p, lower)
    _PRIMITIVE.append(p)
    return p


def is_static(d) -> bool:
    return type(d) is int


def result_shape(shapes: Sequence[tuple]) -> tuple:
    """The broadcast shape of `shapes` (right-aligned) under the rules above."""
    from jax._src.core import max_dim
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        static = [d for d in dims if is_static(d) and d != 1]
        dynamic = [d for d in dims if not is_static(d)]
        if static:
            out.append(static[0])
        elif dynamic:
            size = dynamic[0]
            for d in dynamic[1:]:
                if d is not size and not (d == size):
                    size = max_dim(size, d)
            out.append(size)
        else:
            out.append(1)
    return tuple(out)


def broadcast_to(x, shape: tuple):
    """`x` brought to `shape` (its dimensions aligned to the right) at run time."""
    rank = len(x.shape)
    dims = tuple(range(len(shape) - rank, len(shape)))
    return _primitive().bind(x, shape=tuple(shape), dims=dims)
