"""SPMD annotations inside a program: sharding constraints and manual regions."""
from __future__ import annotations

from jax import lax

from .table import ctx, lowering, out_shape

_PRIM = None


@lowering("xla::sharding_constraint")
def sharding_constraint(x, sharding):
    """The value laid out with `sharding`: XLA's partitioner takes it from here."""
    return lax.with_sharding_constraint(x, sharding)


@lowering("xla::full_to_shard", "xla::manual", "xla::shard_to_full")
def manual_region_edge(x, *args):
    """Edges of a manual region are lowered with the region, as one `shard_map`
    (`executor/manual.py`); reaching one alone means a per-device value left its region,
    which only the HLO text of an unfinished region may show (`ctx.manual_text`): as
    XLA's SPMD custom calls, the form its partitioner reads."""
    from .table import LoweringError
    if not ctx.manual_text:
        raise LoweringError("a per-device value (inside a manual sharding region) can only leave the region "
                            "through disable_manual_sharding / _spmd_shard_to_full_shape")
    if len(args) == 2:  # shard_to_full(sharding, full_shape)
        text = args[0]._to_xla_hlo_sharding(len(args[1])).to_string()
        return _gspmd_call(x, "SPMDShardToFullShape", text)
    return _gspmd_call(x, "SPMDFullToShardShape" if args else "Sharding", "{manual}")


def _gspmd_call(x, target: str, sharding: str):
    """`custom-call(x), custom_call_target=target, sharding=sharding` of the output's shape."""
    return _prim().bind(x, target=target, sharding=sharding, shape=tuple(out_shape()))


def _prim():
    global _PRIM
    if _PRIM is not None:
        return _PRIM
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax.extend import core as jcore

    prim = jcore.Primitive("xla_gspmd_custom_call")
    prim.def_abstract_eval(lambda x, *, target, sharding, shape: core.ShapedArray(shape, x.dtype))

    def lower(ctx_, x, *, target, sharding, shape):
        ty = mlir.aval_to_ir_type(ctx_.module_context, ctx_.avals_out[0])
        # API version 1 (XLA's original custom call), as the partitioner's own calls are.
        op = mlir.custom_call(target, result_types=[ty], operands=[x], api_version=1)
        op.attributes["mhlo.sharding"] = ir.StringAttr.get(sharding)
        return op.results

    mlir.register_lowering(prim, lower)
    _PRIM = prim
    return prim
