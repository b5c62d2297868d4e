"""Integer matrix products: `_XLAC._xla_dot_general` and `torch.ops.xla.quantized_matmul`.

Both keep the integer operands of the dot as they are (`s8 x s8 -> s32`, `bf16 x s8 ->
bf16`): XLA's DotGeneral accepts operands of different element types, and the backends
that have integer matrix units use them only when the dot itself is integer. jax's own
`dot_general` converts mixed operands to the output type before the dot on CPU and GPU,
so mixed products go through a primitive of this module that emits the DotGeneral as is.
"""
from __future__ import annotations

from .table import ctx, lowering, matmul_precision

_PRIM = None


def _mixed_prim():
    """The jax primitive of one DotGeneral whose operands may differ in element type."""
    global _PRIM
    if _PRIM is not None:
        return _PRIM
    import jax
    import numpy as np
    from jax import lax
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lax import lax as lax_internal
    from jax._src.lib.mlir.dialects import hlo
    from jax.extend import core as jcore

    prim = jcore.Primitive("xla_mixed_dot_general")

    def abstract(lhs, rhs, *, dimension_numbers, preferred, precision):
        shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dimension_numbers),
                               jax.ShapeDtypeStruct(lhs.shape, np.float32),
                               jax.ShapeDtypeStruct(rhs.shape, np.float32)).shape
        return core.ShapedArray(shape, preferred)

    def lower(ctx_, lhs, rhs, *, dimension_numbers, preferred, precision):
        (lc, rc), (lb, rb) = dimension_numbers
        dnums = hlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=list(lb), rhs_batching_dimensions=list(rb),
            lhs_contracting_dimensions=list(lc), rhs_contracting_dimensions=list(rc))
        ty = mlir.aval_to_ir_type(ctx_.module_context, ctx_.avals_out[0])
        attr = lax_internal.precision_attr(lax_internal.canonicalize_precision(precision))
        return [hlo.dot_general(ty, lhs, rhs, dnums, precision_config=attr)]

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lower)
    _PRIM = prim
    return prim


def dot(lhs, rhs, dimension_numbers, preferred):
    """DotGeneral of `lhs` and `rhs` with result type `preferred` (a numpy dtype), the
    operands' element types kept."""
    import numpy as np
    from jax import lax
    preferred = np.dtype(preferred)
    if lhs.dtype == rhs.dtype:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=matmul_precision(),
                               preferred_element_type=preferred)
    return _mixed_prim().bind(lhs, rhs, dimension_numbers=dimension_numbers, preferred=preferred,
                              precision=matmul_precision())


@lowering("xla::typed_dot_general")
def typed_dot_general(lhs, rhs, dimension_numbers, preferred):
    """`_XLAC._xla_dot_general`: ((lhs contracting, rhs contracting), (lhs batch, rhs
    batch)) and the result's element type."""
    return dot(lhs, rhs, dimension_numbers, preferred)


def _int4_dots() -> bool:
    """Whether to emit a DotGeneral with an s4 operand: yes, but in a program compiled for a
    backend without one (XLA:CPU: its operand upcasting makes an invalid sub-byte layout;
    the platform policy's `widen_int4_dots`)."""
    return not ctx.widen_int4_dots


def _weight(w, int4: bool):
    """The weight operand: int4 weights come in an int8 container and are narrowed to s4
    (values outside [-8, 7] wrap, as the s4 type does); where the backend has no s4 dot
    they are widened back to s8 after the narrowing, which keeps their values."""
    import jax.numpy as jnp
    if not int4:
        return w
    w4 = w.astype(jnp.int4)
    return w4 if _int4_dots() else w4.astype(jnp.int8)


def _quantize_rows(x):
    """Symmetric int8 quantization of `x` along its last dimension, in `x`'s dtype:
    (int8 values, scale of shape [..., 1])."""
    import jax.numpy as jnp
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / jnp.asarray(127, x.dtype)
    return jnp.round(x / scale).astype(jnp.int8), scale


@lowering("xla::quantized_matmul")
def quantized_matmul(x, w, scale, *rest):
    """rest: [zero_point,] block_size, int4_weight, quantize_activation, has_zero_point.

    Per-channel: w [N, K], scale / zero point [N]. Blockwise: w [K / B, B, N], scale /
    zero point [K / B, N]. The dot's result type is the activation's (s32 for quantized
    activations); scaling and zero points are applied in float32 for half precision
    activations (rounded once, to the op's dtype, by `apply`).
    """
    import jax.numpy as jnp
    import numpy as np
    from .table import out_dtype
    *zp, block_size, int4, quantize_activation, has_zero_point = rest
    zero_point = zp[0] if has_zero_point else None
    acc = np.promote_types(out_dtype(), np.float32)
    w = _weight(w, int4)
    nd = x.ndim
    if block_size == -1:
        if quantize_activation:
            x, x_scale = _quantize_rows(x)
            out = dot(x, w, (((nd - 1,), (1,)), ((), ())), np.int32)
        else:
            out = dot(x, w, (((nd - 1,), (1,)), ((), ())), x.dtype)
        out = out.astype(acc) * scale.astype(acc)
        if zero_point is not None:
            out = out - jnp.sum(x.astype(acc), axis=-1, keepdims=True) * zero_point.astype(acc)
        if quantize_activation:
            out = out * x_scale.astype(acc)
        return out
    xb = jnp.reshape(x, x.shape[:-1] + (x.shape[-1] // block_size, block_size))
    # Batched over the blocks: [S, ..., N], then summed over the blocks with their scales.
    part = dot(xb, w, (((nd,), (1,)), ((nd - 1,), (0,))), x.dtype).astype(acc)
    s = scale.astype(acc).reshape((scale.shape[0],) + (1,) * (nd - 1) + (scale.shape[1],))
    out = jnp.sum(part * s, axis=0)
    if zero_point is not None:
        out = out - jnp.matmul(jnp.sum(xb.astype(acc), axis=-1), zero_point.astype(acc),
                               precision=matmul_precision())
    return out
