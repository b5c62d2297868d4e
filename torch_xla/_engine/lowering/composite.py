"""StableHLO composites: a marked pattern of a graph as one `stablehlo.composite` op.

`torch.ops.xla.mark_tensor` (`StableHLOCompositeBuilder`) makes `xla::mark_tensor`
nodes; `executor/composites.py` finds each pattern between its input and output marks
and lowers it through `composite()`: the op carries the pattern's name and attributes,
and its decomposition function, `@<name>.impl`, holds the pattern's ops (XLA inlines it).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .table import lowering


@lowering("xla::mark_tensor")
def mark_tensor(x, name, pos, pattern_id, is_input, attr):
    """A mark outside a pattern (or one that cannot be grouped) is the value itself."""
    return x


_PRIMITIVE = []


def _primitive():
    """The composite primitive: jax's own, bound under a decomposition name of its own
    (jax names the decomposition after the op; the format names it `<name>.impl`)."""
    if _PRIMITIVE:
        return _PRIMITIVE[0]
    from jax.extend.core import Primitive, jaxpr_as_fun
    from jax.interpreters import mlir
    from jax._src.lax import lax as jax_lax   # jax's composite lowering, reused unchanged
    from jax._src.lib.mlir import ir

    p = Primitive("xla_composite")
    p.multiple_results = True
    p.def_impl(lambda *args, jaxpr, **_: jaxpr_as_fun(jaxpr)(*args))
    p.def_abstract_eval(lambda *args, jaxpr, **_: jaxpr.out_avals)

    def lower(ctx, *args, name, impl_name, attributes, jaxpr):
        # The first free name of impl_name, impl_name_0, impl_name_1...: MLIR's own
        # renaming counts every clash in the module (the decomposition's helpers too).
        table, free, k = ctx.module_context.symbol_table, impl_name, 0
        while free in table:
            free, k = f"{impl_name}_{k}", k + 1
        from jax.tree_util import tree_flatten
        attrs = []
        for key, v in attributes:
            leaves, tree = tree_flatten(attr_value(v))
            attrs.append((key, tuple(leaves), tree))
        results = jax_lax._composite_lowering(ctx, *args, name=free, attributes=tuple(attrs), version=0,
                                              jaxpr=jaxpr)
        results[0].owner.attributes["name"] = ir.StringAttr.get(name)
        return results

    mlir.register_lowering(p, lower)
    _PRIMITIVE.append(p)
    return p


def attr_value(v):
    """A composite attribute as the format types it: float -> f32, int -> i64, bool,
    str; a list -> a dense array of f32, i64 or i1."""
    if isinstance(v, (list, tuple)):
        kinds = {type(e) for e in v}
        dtype = np.bool_ if kinds == {bool} else np.int64 if kinds == {int} else np.float32
        return np.asarray(v, dtype=dtype)
    if isinstance(v, float):
        return np.float32(v)
    return v


def composite(body: Callable, name: str, attrs: Sequence[tuple], operands: Sequence) -> tuple:
    """`stablehlo.composite "<name>"(operands)` whose decomposition is `body(*operands)`
    (a function of jax values returning a tuple); `attrs`: (key, value) pairs."""
    import jax
    closed = jax.make_jaxpr(body)(*operands)
    attributes = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs)   # hashable
    return tuple(_primitive().bind(*operands, name=name, impl_name=name + ".impl", attributes=attributes,
                                   jaxpr=closed))
