"""Computations the user built by hand (`torch_xla.core.xla_builder`), applied to tensors.

The static argument is the computation object itself: it hashes and compares by the
text of its program, so two computations built alike share one compiled graph.
"""
from __future__ import annotations

from .table import lowering, matmul_precision


@lowering("xla::user_computation")
def user_computation(*args):
    """args: the inputs' jax values, the op's name, the computation. Returns the
    computation's result as its leaves."""
    comp = args[-1]
    return tuple(comp.flat_call(*args[:-2]))


@lowering("xla::dot_general")
def dot_general(lhs, rhs, dimension_numbers, preferred):
    """XLA's DotGeneral: ((lhs contracting, rhs contracting), (lhs batch, rhs batch))."""
    from jax import lax
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=matmul_precision(),
                           preferred_element_type=preferred)


_CUSTOM_CALL = None


def _custom_call_prim():
    """The jax primitive of one `stablehlo.custom_call` (several results: one tuple-typed
    result and its elements, as XLA's custom call returns them)."""
    global _CUSTOM_CALL
    if _CUSTOM_CALL is not None:
        return _CUSTOM_CALL
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo
    from jax.extend import core as jcore

    prim = jcore.Primitive("xla_stablehlo_custom_call")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *args, out, **_: [core.ShapedArray(s, d) for s, d in out])

    def lower(lctx, *args, target, side_effect, backend_config, api_version, attributes, out):
        types = [mlir.aval_to_ir_type(lctx.module_context, a) for a in lctx.avals_out]
        result = types if len(types) == 1 else [ir.TupleType.get_tuple(types)]
        op = mlir.custom_call(target, result_types=result, operands=list(args), backend_config=backend_config,
                              has_side_effect=side_effect, api_version=api_version)
        if attributes:
            op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
                {k: ir.StringAttr.get(v) for k, v in attributes})
        if len(types) == 1:
            return op.results
        return [hlo.get_tuple_element(op.result, mlir.i32_attr(i)) for i in range(len(types))]

    mlir.register_lowering(prim, lower)
    _CUSTOM_CALL = prim
    return prim


@lowering("xla::custom_call")
def custom_call(*args):
    """args: the operands' jax values, then the call target, whether it has side effects,
    the backend config string, the API version and the frontend attributes ((key, value)
    pairs). The results' shapes and dtypes are the node's."""
    from .table import ctx
    target, side_effect, backend_config, api_version, attributes = args[-5:]
    # XLA refuses API_VERSION_UNSPECIFIED (0) when compiling: unspecified is the original API
    api_version = api_version or 1
    out = tuple((tuple(s), d) for s, d in ctx.out)
    res = _custom_call_prim().bind(*args[:-5], target=target, side_effect=bool(side_effect),
                                   backend_config=backend_config, api_version=int(api_version),
                                   attributes=tuple(attributes), out=out)
    return res[0] if len(res) == 1 else tuple(res)
