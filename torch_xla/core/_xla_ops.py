"""The operations of `xla_builder`: XLA element types and one jax function per XLA op.

Each function takes the operands' jax values (tuples for tuple shapes) and the op's
attributes as keyword arguments; computations given as attributes are callables on jax
values (`xla_builder.Computation`).
"""
from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import torch

class Type:
    """XLA element type names."""
    F32 = 'f32'
    F64 = 'f64'
    BF16 = 'bf16'
    F16 = 'f16'
    U8 = 'u8'
    S8 = 's8'
    U16 = 'u16'
    S16 = 's16'
    U32 = 'u32'
    S32 = 's32'
    U64 = 'u64'
    S64 = 's64'
    C64 = 'c64'
    C128 = 'c128'
    PRED = 'pred'


_XLA_PT_TYPE_MAP = {
    Type.F32: torch.float32, Type.F64: torch.float64, Type.BF16: torch.bfloat16,
    Type.F16: torch.float16, Type.U8: torch.uint8, Type.S8: torch.int8,
    Type.U16: torch.uint16, Type.S16: torch.int16, Type.U32: torch.uint32,
    Type.S32: torch.int32, Type.U64: torch.uint64, Type.S64: torch.int64,
    Type.C64: torch.complex64, Type.C128: torch.complex128, Type.PRED: torch.bool,
}
_PT_XLA_TYPE_MAP = {v: k for k, v in _XLA_PT_TYPE_MAP.items()}


def _np_dtype(xla_type: str) -> np.dtype:
    from .._engine import pjrt
    return pjrt.numpy_dtype(_XLA_PT_TYPE_MAP[xla_type])


def _xla_type(np_dtype) -> str:
    from .._engine import pjrt
    return _PT_XLA_TYPE_MAP[pjrt.torch_dtype(np_dtype)]


def _jax():
    from .._engine import pjrt
    return pjrt.jax_module()

def _raw_shape(shape):
    """A Shape object's raw form (dict or list); raw shapes as they are."""
    return shape if isinstance(shape, (dict, list, tuple)) else shape.shape


def _aval_of_shape(shape):
    """A raw XLA shape (dict or list of them) -> jax ShapeDtypeStruct tree."""
    jax = _jax()
    shape = _raw_shape(shape)
    if isinstance(shape, (list, tuple)):
        return tuple(_aval_of_shape(s) for s in shape)
    if shape.get('dynamic_dimensions') and any(shape['dynamic_dimensions']):
        raise ValueError("dynamic dimensions are not supported: jax compiles static shapes only")
    return jax.ShapeDtypeStruct(tuple(shape['sizes']), _np_dtype(shape['type']))

def _lax():
    _jax()
    from jax import lax
    return lax


def _jnp():
    _jax()
    import jax.numpy as jnp
    return jnp


def _binary(lax_fn_name: str):
    def fn(a, b):
        jnp = _jnp()
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.dtype != b.dtype:
            raise TypeError(f"binary op {lax_fn_name} with different element types: "
                            f"{_xla_type(a.dtype)} and {_xla_type(b.dtype)}")
        if a.shape != b.shape:
            a, b = jnp.broadcast_arrays(a, b)
        return getattr(_lax(), lax_fn_name)(a, b)
    return fn


def _shift_right(a, b):
    lax = _lax()
    if np.issubdtype(a.dtype, np.signedinteger):
        return lax.shift_right_arithmetic(a, b)
    return lax.shift_right_logical(a, b)


def _padding(padding):
    if isinstance(padding, str):
        p = padding.upper()
        if p not in ("SAME", "VALID"):
            raise ValueError(f"Invalid padding: {padding}")
        return p
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def _conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                          dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                          precision_config=None):
    lax = _lax()
    return lax.conv_general_dilated(
        lhs, rhs, tuple(window_strides), _padding(padding),
        lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
        rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count, precision=_precision(precision_config),
        preferred_element_type=lhs.dtype)


def _precision(name):
    if name is None:
        return None
    lax = _lax()
    return {'default': lax.Precision.DEFAULT, 'high': lax.Precision.HIGH,
            'highest': lax.Precision.HIGHEST}[str(name).lower()]


def _conv_dimension_numbers(input_batch_dimension, input_feature_dimension, kernel_input_feature_dimension,
                            kernel_output_feature_dimension, output_batch_dimension,
                            output_feature_dimension, input_spatial_dimensions, kernel_spatial_dimensions,
                            output_spatial_dimensions):
    lax = _lax()
    return lax.ConvDimensionNumbers(
        lhs_spec=(input_batch_dimension, input_feature_dimension) + tuple(input_spatial_dimensions),
        rhs_spec=(kernel_output_feature_dimension, kernel_input_feature_dimension) + tuple(kernel_spatial_dimensions),
        out_spec=(output_batch_dimension, output_feature_dimension) + tuple(output_spatial_dimensions))


def _scalar_fn(computation: Callable):
    return lambda *xs: computation(*xs)


def _reduce(x, init, computation, dimensions):
    return _lax().reduce(x, init, _scalar_fn(computation), tuple(dimensions))


def _reduce_window(x, init, computation, window_dimensions, window_strides, padding='valid'):
    return _lax().reduce_window(x, init, _scalar_fn(computation), tuple(window_dimensions),
                                tuple(window_strides), _padding(padding))


def _max_pool(x, kernel_size, stride, batch_dimension, feature_dimension, spatial_dimensions,
              padding='valid'):
    """XLA's MaxPool: `kernel_size` and `stride` give the window of every dimension (as XLA's
    builder takes them), or of `spatial_dimensions` only, the batch and feature dimensions
    then being the other two (a window of 1)."""
    lax = _lax()
    jnp = _jnp()
    rank = x.ndim
    if len(kernel_size) == rank and len(stride) == rank:
        window, strides = [int(k) for k in kernel_size], [int(s) for s in stride]
    else:
        spatial = [int(d) for d in spatial_dimensions]
        layout = [int(batch_dimension), int(feature_dimension)] + spatial
        if sorted(layout) != list(range(rank)):
            raise ValueError(f"MaxPool: batch dimension {batch_dimension}, feature dimension {feature_dimension} "
                             f"and spatial dimensions {list(spatial_dimensions)} must name each of the operand's "
                             f"{rank} dimensions once")
        if not len(kernel_size) == len(stride) == len(spatial):
            raise ValueError(f"MaxPool: kernel_size {list(kernel_size)} and stride {list(stride)} need one entry "
                             f"per dimension ({rank}) or per spatial dimension ({len(spatial)})")
        window, strides = [1] * rank, [1] * rank
        for d, k, s in zip(spatial, kernel_size, stride):
            window[d], strides[d] = int(k), int(s)
    init = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    return lax.reduce_window(x, jnp.asarray(init, x.dtype), lax.max, tuple(window), tuple(strides),
                             _padding(padding))


def _map(*args, computation, dimensions, n):
    jax = _jax()
    ops, static = args[:n], args[n:]
    f = lambda *xs: computation(*(xs + tuple(static)))  # noqa: E731
    rank = ops[0].ndim
    if sorted(dimensions) != list(range(rank)):
        raise ValueError(f"Map applies over every dimension (0..{rank - 1}), got {list(dimensions)}")
    for _ in range(rank):
        f = jax.vmap(f)
    return f(*ops)


def _triangular_solve(a, b, left_side=None, lower=None, unit_diagonal=None, transpose_a=None):
    lax = _lax()
    transpose_a = {None: False, False: False, True: True, 'NO_TRANSPOSE': False, 'TRANSPOSE': True}.get(
        transpose_a, transpose_a)
    return lax.linalg.triangular_solve(a, b, left_side=bool(left_side), lower=bool(lower),
                                       unit_diagonal=bool(unit_diagonal), transpose_a=bool(transpose_a))


def _gather(x, idx, offset_dims, collapsed_slice_dims, start_index_map, index_vector_dim, slice_sizes,
            indices_are_sorted=None):
    lax = _lax()
    jnp = _jnp()
    if index_vector_dim != idx.ndim:  # jax wants the index vector last
        idx = jnp.moveaxis(idx, index_vector_dim, -1)
    dn = lax.GatherDimensionNumbers(offset_dims=tuple(offset_dims), collapsed_slice_dims=tuple(collapsed_slice_dims),
                                    start_index_map=tuple(start_index_map))
    if index_vector_dim == idx.ndim:
        idx = idx[..., None]
    return lax.gather(x, idx, dn, tuple(slice_sizes), indices_are_sorted=bool(indices_are_sorted),
                      mode=lax.GatherScatterMode.CLIP)


def _scatter(x, idx, upd, computation, update_window_dims, inserted_window_dims, scatter_dims_to_operand_dims,
             index_vector_dim, indices_are_sorted=None, unique_indices=None):
    lax = _lax()
    jnp = _jnp()
    if index_vector_dim == idx.ndim:
        idx = idx[..., None]
    elif index_vector_dim != idx.ndim - 1:
        idx = jnp.moveaxis(idx, index_vector_dim, -1)
    dn = lax.ScatterDimensionNumbers(update_window_dims=tuple(update_window_dims),
                                     inserted_window_dims=tuple(inserted_window_dims),
                                     scatter_dims_to_operand_dims=tuple(scatter_dims_to_operand_dims))
    if computation is None:
        return lax.scatter(x, idx, upd, dn, indices_are_sorted=bool(indices_are_sorted),
                           unique_indices=bool(unique_indices))
    jaxpr = _jax().make_jaxpr(_scalar_fn(computation))(
        *[_jax().ShapeDtypeStruct((), x.dtype)] * 2)
    from jax._src.lax import slicing
    return slicing.scatter_p.bind(x, idx, upd, update_jaxpr=jaxpr.jaxpr, update_consts=tuple(jaxpr.consts),
                                  dimension_numbers=dn, indices_are_sorted=bool(indices_are_sorted),
                                  unique_indices=bool(unique_indices), mode=lax.GatherScatterMode.FILL_OR_DROP)


def _reshape(x, sizes, dimensions=None):
    return _lax().reshape(x, tuple(sizes), None if dimensions is None else tuple(dimensions))


def _pad(x, value, config):
    return _lax().pad(x, value, tuple((int(lo), int(hi), int(interior)) for lo, hi, interior in config))


def _convert(x, to_type):
    return _lax().convert_element_type(x, _np_dtype(to_type))


def _bitcast(x, to_type):
    return _lax().bitcast_convert_type(x, _np_dtype(to_type))


def _dynamic_slice(x, *starts, slice_sizes):
    return _lax().dynamic_slice(x, starts, tuple(slice_sizes))


def _dynamic_update_slice(x, update, *starts):
    return _lax().dynamic_update_slice(x, update, starts)


def _conditional(pred, t_operand, f_operand, true_computation, false_computation):
    lax = _lax()
    branches = (lambda ops: false_computation(ops[1]), lambda ops: true_computation(ops[0]))
    if pred.dtype == np.bool_:
        return lax.cond(pred, branches[1], branches[0], (t_operand, f_operand))
    raise TypeError(f"Conditional predicate must be pred, got {_xla_type(pred.dtype)}")


def _while(init, condition_computation, body_computation):
    return _lax().while_loop(lambda v: condition_computation(v), lambda v: body_computation(v), init)


def _iota(shape, iota_dimension):
    aval = _aval_of_shape(shape)
    return _lax().broadcasted_iota(aval.dtype, aval.shape, iota_dimension)


def _constant(value):
    jnp = _jnp()
    from .._engine import pjrt
    if isinstance(value, torch.Tensor):
        return jnp.asarray(pjrt.to_numpy(value.cpu()))
    return jnp.asarray(value)


def _get_dimension_size(x, dimension):
    return _jnp().asarray(x.shape[dimension], np.int32)


def _clamp(lo, x, hi):
    return _lax().clamp(lo, x, hi)


def _transpose(x, permutation):
    return _lax().transpose(x, tuple(permutation))


def _dot(a, b, precision_config=None):
    return _lax().dot(a, b, precision=_precision(precision_config))


def _unary(name):
    return lambda x: getattr(_lax(), name)(x)


# name -> (jax function of the operand values, names of the kwargs it takes as static values)
def _table() -> Dict[str, Callable]:
    lax_binary = {'Add': 'add', 'Sub': 'sub', 'Mul': 'mul', 'Div': 'div', 'Pow': 'pow', 'Rem': 'rem',
                  'And': 'bitwise_and', 'Or': 'bitwise_or', 'Xor': 'bitwise_xor', 'Eq': 'eq', 'Ne': 'ne',
                  'Le': 'le', 'Lt': 'lt', 'Ge': 'ge', 'Gt': 'gt', 'ShiftLeft': 'shift_left',
                  'Atan2': 'atan2', 'Max': 'max', 'Min': 'min'}
    lax_unary = {'Neg': 'neg', 'Acos': 'acos', 'Asin': 'asin', 'Atan': 'atan', 'Ceil': 'ceil', 'Cos': 'cos',
                 'Cosh': 'cosh', 'Erf': 'erf', 'Erfc': 'erfc', 'ErfInv': 'erf_inv', 'Exp': 'exp',
                 'Expm1': 'expm1', 'Floor': 'floor', 'Log': 'log', 'Log1p': 'log1p', 'Sqrt': 'sqrt',
                 'Real': 'real', 'Imag': 'imag', 'Clz': 'clz', 'Conj': 'conj', 'Rsqrt': 'rsqrt', 'Sin': 'sin',
                 'Sinh': 'sinh', 'Tan': 'tan', 'Tanh': 'tanh', 'Abs': 'abs', 'Sign': 'sign',
                 'Not': 'bitwise_not'}
    t = {k: _binary(v) for k, v in lax_binary.items()}
    t.update({k: _unary(v) for k, v in lax_unary.items()})
    t.update({
        'ShiftRight': _shift_right, 'Dot': _dot, 'Reshape': _reshape,
        'Broadcast': lambda x, sizes: _lax().broadcast(x, tuple(sizes)),
        'BroadcastInDim': lambda x, sizes, dimensions: _lax().broadcast_in_dim(x, tuple(sizes), tuple(dimensions)),
        'Slice': lambda x, start_indices, limit_indices, strides=None: _lax().slice(
            x, tuple(start_indices), tuple(limit_indices), None if strides is None else tuple(strides)),
        'SliceInDim': lambda x, start_index, limit_index, dimno, stride=1: _lax().slice_in_dim(
            x, start_index, limit_index, stride, dimno),
        'DynamicSlice': _dynamic_slice, 'DynamicUpdateSlice': _dynamic_update_slice,
        'Gather': _gather, 'Scatter': _scatter, 'ConvGeneralDilated': _conv_general_dilated,
        'Convert': _convert, 'BitcastConvert': _bitcast, 'Pad': _pad, 'MaxPool': _max_pool,
        'Reduce': _reduce, 'ReduceAll': lambda x, init, computation: _reduce(x, init, computation, range(x.ndim)),
        'ReduceWindow': _reduce_window, 'Select': lambda p, a, b: _lax().select(p, a, b),
        'Transpose': _transpose, 'TriangularSolve': _triangular_solve, 'Clamp': _clamp,
        'GetTupleElement': lambda x, index: x[index], 'Conditional': _conditional, 'While': _while,
        'GetDimensionSize': _get_dimension_size, 'Rev': lambda x, dimensions: _lax().rev(x, tuple(dimensions)),
        'Tuple': lambda *xs: tuple(xs),
        'ConcatInDim': lambda *xs, dimension: _lax().concatenate(xs, dimension),
        'Call': lambda *xs, computation: computation(*xs),
        'Map': _map,
    })
    return t


_OPS: Dict[str, Callable] = {}


def _op_table() -> Dict[str, Callable]:
    if not _OPS:
        _OPS.update(_table())
    return _OPS


def _conv_kwargs(kwargs):
    """The Conv* family's keyword arguments -> those of ConvGeneralDilated."""
    keys = ('input_batch_dimension', 'input_feature_dimension', 'kernel_input_feature_dimension',
            'kernel_output_feature_dimension', 'output_batch_dimension', 'output_feature_dimension',
            'input_spatial_dimensions', 'kernel_spatial_dimensions', 'output_spatial_dimensions')
    out = {k: v for k, v in kwargs.items() if k not in keys}
    if all(k in kwargs for k in keys):
        out['dimension_numbers'] = _conv_dimension_numbers(*[kwargs[k] for k in keys])
    return out
