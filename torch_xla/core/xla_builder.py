"""Building XLA computations by hand and running them on xla tensors.

An `Op` is a node of a computation under construction: it belongs to a builder, has an
XLA shape (`Op.shape()`), and combines with other ops through operators and methods
named after XLA's operation semantics (https://openxla.org/xla/operation_semantics).
`create_computation(name, fn, shapes)` calls `fn` on one parameter op per shape and
builds the computation rooted at its result; `_XLAC._xla_user_computation` (or
`torch_xla.core.xla_op_registry.register`) applies it to tensors inside the lazy graph.

Each op is a jax function of its operands' values (`jax.lax`): the computation is
lowered to StableHLO through jax when the graph that uses it is compiled. Shapes are
inferred op by op as they are built, so a shape or dtype error is raised by the line
that builds the bad op. Tuple shapes are Python tuples of values.
Not available (jax has no equivalent): XLA's bounded dynamic shapes
(`dynamic_reshape`, `set_dimension_size`), sorts with an arbitrary comparator
computation, and `select_and_scatter` with arbitrary select/scatter computations.
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Set, Union

import numpy as np
import torch


from ._xla_ops import (Type, _XLA_PT_TYPE_MAP, _PT_XLA_TYPE_MAP, _aval_of_shape, _conv_kwargs,  # noqa: F401
                       _jax, _np_dtype, _op_table, _raw_shape, _xla_type, _constant, _iota)
# Jax functions inside the lazy graph.
from ._jax_call import (_JAX_TO_XLA_COMPUTATION_CACHE, _jax_to_xla_computation_cache_elements,  # noqa: F401
                        apply_jax_function, call_jax, call_jax_flat, jax_function)
# Functions of pytrees as flat calls, and tensors without a buffer.
from ._flat_calls import (CompiledCallableWithCache, FlattenedInputFunc, _NoBuffer, _placeholder,  # noqa: F401
                          computation_from_module_proto)


# Functions whose ignored keyword arguments were already warned about (once per process each).
_WARNED: Set[str] = set()


def _ignored_kwargs(fn: str, kwargs: dict) -> None:
    """PyTorch/XLA's `fn` takes `**kwargs` and ignores them: warns once that they do nothing."""
    if kwargs and fn not in _WARNED:
        _WARNED.add(fn)
        warnings.warn(f"Op.{fn}: keyword arguments {sorted(kwargs)} have no effect (PyTorch/XLA's {fn} "
                      f"accepts and ignores them)", UserWarning, stacklevel=3)


class Shape:
    """An XLA shape: an array shape `{'type': 'f32', 'sizes': (2, 3)}` or a tuple of shapes."""

    def __init__(self, shape):
        self._shape = shape

    @classmethod
    def create(cls, dtype: str, sizes: Sequence[int], dynamic_dimensions=None) -> "Shape":
        s = {'type': str(dtype), 'sizes': tuple(int(x) for x in sizes)}
        if dynamic_dimensions is not None:
            s['dynamic_dimensions'] = tuple(dynamic_dimensions)
        return Shape(s)

    @property
    def shape(self):
        return self._shape

    def is_tuple(self) -> bool:
        return isinstance(self._shape, (list, tuple))

    def tuple_size(self) -> int:
        assert self.is_tuple()
        return len(self._shape)

    def tuple_shape(self, index: int):
        assert self.is_tuple()
        return self._shape[index]

    def is_dynamic(self) -> bool:
        assert not self.is_tuple()
        return 'dynamic_dimensions' in self._shape

    def as_scalar(self) -> "Shape":
        return Shape.create(self.dtype, ())

    @property
    def rank(self) -> int:
        assert not self.is_tuple()
        return len(self._shape['sizes'])

    @property
    def sizes(self):
        assert not self.is_tuple()
        return self._shape['sizes']

    @property
    def dynamic_dimensions(self):
        assert not self.is_tuple()
        return self._shape.get('dynamic_dimensions', None)

    @property
    def dtype(self) -> str:
        assert not self.is_tuple()
        return self._shape['type']

    def __repr__(self):
        return f"Shape({self._shape})"


def _shape_of_aval(aval):
    if isinstance(aval, tuple):
        return [_shape_of_aval(a) for a in aval]
    return {'type': _xla_type(aval.dtype), 'sizes': tuple(int(d) for d in aval.shape)}


class Builder:
    """Collects the parameters of one computation under construction."""

    def __init__(self, name: str):
        self.name = name
        self.params: Dict[int, "_Node"] = {}

    def __repr__(self):
        return f"Builder({self.name!r})"


class _Node:
    """One op: `fn(*operand values)` -> value; `aval` its shape (a jax aval tree)."""
    __slots__ = ("builder", "kind", "fn", "operands", "aval", "param_no", "label")

    def __init__(self, builder, kind, fn, operands, aval, param_no=None, label=""):
        self.builder = builder
        self.kind = kind  # 'param', 'op'
        self.fn = fn
        self.operands = tuple(operands)
        self.aval = aval
        self.param_no = param_no
        self.label = label


class Computation:
    """A built computation: parameters' shapes, root, and the jax function they make.

    Hashes and compares by its program's text, so equal computations share graphs."""

    def __init__(self, name: str, params: List[_Node], root: _Node):
        self.name = name
        self._params = params
        self._root = root
        self.param_shapes = [Shape(_shape_of_aval(p.aval)) for p in params]
        self.result_shape = Shape(_shape_of_aval(root.aval))
        jax = _jax()
        closed = jax.make_jaxpr(self.__call__)(*[p.aval for p in params])
        consts = hashlib.sha256()
        for c in closed.consts:
            a = np.asarray(c)
            consts.update(str((a.shape, a.dtype)).encode())
            consts.update(a.tobytes())
        self.fingerprint = hashlib.sha256((str(closed.jaxpr) + consts.hexdigest()).encode()).hexdigest()

    def __call__(self, *args):
        """Evaluates the computation on jax values (one value tree per parameter)."""
        if len(args) != len(self._params):
            raise TypeError(f"computation {self.name} takes {len(self._params)} parameters, got {len(args)}")
        values = {id(p): a for p, a in zip(self._params, args)}
        return _evaluate(self._root, values, self.name)

    def flat_call(self, *args) -> list:
        """`self(*args)` with every parameter an array; a tuple result as its elements."""
        jax = _jax()
        return jax.tree_util.tree_leaves(self(*args))

    def __hash__(self):
        return hash(self.fingerprint)

    def __eq__(self, other):
        return isinstance(other, Computation) and other.fingerprint == self.fingerprint

    def __repr__(self):
        return f"Computation({self.name}, {self.fingerprint[:16]})"

    def hlo_text(self) -> str:
        jax = _jax()
        lowered = jax.jit(self.__call__).lower(*[p.aval for p in self._params])
        return lowered.as_text(dialect="hlo")


def _evaluate(root: _Node, values: dict, name: str):
    # Iterative post-order walk: hand-built graphs can be deep chains.
    stack = [root]
    while stack:
        n = stack[-1]
        if id(n) in values:
            stack.pop()
            continue
        if n.kind == 'param':
            raise ValueError(f"parameter {n.param_no} of builder {n.builder.name!r} is not a parameter "
                             f"of computation {name!r}")
        missing = [o for o in n.operands if id(o) not in values]
        if missing:
            stack.extend(missing)
            continue
        values[id(n)] = n.fn(*[values[id(o)] for o in n.operands])
        stack.pop()
    return values[id(root)]


def _node_of(x) -> _Node:
    if isinstance(x, Op):
        return x.op
    if isinstance(x, _Node):
        return x
    raise TypeError(f"expected an xla_builder Op, got {type(x).__name__}")


def _make(builder: Builder, fn: Callable, operands: Sequence[_Node], label: str) -> "Op":
    """A new op of `builder`: its shape is inferred now (errors point at this line)."""
    jax = _jax()
    aval = jax.eval_shape(fn, *[o.aval for o in operands])
    return Op(_Node(builder, 'op', fn, operands, aval, label=label))


def mkop(name: str, ops: Sequence, **kwargs) -> "Op":
    """The XLA operation `name` (e.g. 'Add', 'Reshape', 'Gather') applied to `ops` with the
    operation's attributes as keyword arguments (`builder=` for an op without operands)."""
    builder = kwargs.pop('builder', None)
    nodes = [_node_of(o) for o in ops]
    if builder is None:
        if not nodes:
            raise ValueError(f"{name}: an op without operands needs builder=")
        builder = nodes[0].builder
    if name in ('Conv', 'ConvWithGeneralPadding', 'ConvWithGeneralDimensions', 'ConvGeneral'):
        kwargs = _conv_kwargs(kwargs)
        name = 'ConvGeneralDilated'
    elif name == 'ConvGeneralDilated':
        kwargs = _conv_kwargs(kwargs)
    # Ops given as attributes (a dynamic slice's start indices) are operands too.
    extra = []
    for key in ('start_indices',):
        v = kwargs.get(key)
        if name in ('DynamicSlice', 'DynamicUpdateSlice') and v is not None:
            extra = [_node_of(o) for o in v]
            del kwargs[key]
    for key in ('static_operands',):
        if key in kwargs:
            extra = [_node_of(o) for o in kwargs.pop(key)]
            kwargs['n'] = len(nodes)
    for key, v in list(kwargs.items()):
        if callable(v) and not isinstance(v, Computation) and key.endswith('computation'):
            raise TypeError(f"{name}: {key} must be a built Computation (see Op.make_computation)")
    try:
        fn = _op_table()[name]
    except KeyError:
        raise ValueError(f"unknown or unsupported XLA operation {name!r}") from None
    kw = {k: v for k, v in kwargs.items() if v is not None or k in ('computation',)}
    return _make(builder, lambda *xs: fn(*xs, **kw), nodes + extra, name)


def mkleaf(name: str, builder: Builder, **kwargs) -> "Op":
    """An op without operands: 'Constant' (value=) or 'Iota' (shape=, iota_dimension=)."""
    if name == 'Constant':
        value = _constant(kwargs['value'])
        return _make(builder, lambda: value, (), name)
    if name == 'Iota':
        shape, dim = kwargs['shape'], kwargs['iota_dimension']
        return _make(builder, lambda: _iota(shape, dim), (), name)
    raise ValueError(f"unknown leaf operation {name!r}")


def create_builder(name: str) -> Builder:
    return Builder(name)


def mkshape(dtype: str, sizes: Sequence[int], dynamic_dimensions=None) -> Shape:
    return Shape.create(dtype, sizes, dynamic_dimensions=dynamic_dimensions)


def mkparam(builder: Builder, param_no: int, shape: Union[Shape, dict, list]) -> "Op":
    """Parameter number `param_no` of the computation `builder` builds."""
    if param_no in builder.params:
        raise ValueError(f"builder {builder.name!r} already has parameter {param_no}")
    node = _Node(builder, 'param', None, (), _aval_of_shape(shape), param_no=param_no, label=f"p{param_no}")
    builder.params[param_no] = node
    return Op(node)


class Op:
    """An operation of a computation under construction (wraps an `_Node` as `.op`)."""

    def __init__(self, op: _Node):
        self.op = op

    def shape(self) -> Shape:
        return Shape(_shape_of_aval(self.op.aval))

    def builder(self) -> Builder:
        return self.op.builder

    def build(self, name: str) -> Computation:
        """The computation of this op's builder rooted at this op."""
        b = self.op.builder
        n = len(b.params)
        if sorted(b.params) != list(range(n)):
            raise ValueError(f"builder {b.name!r} has parameters {sorted(b.params)}: numbers must be 0..{n - 1}")
        return Computation(name, [b.params[i] for i in range(n)], self.op)

    def __add__(self, rhs): return mkop('Add', (self, rhs))
    def __sub__(self, rhs): return mkop('Sub', (self, rhs))
    def __mul__(self, rhs): return mkop('Mul', (self, rhs))
    def __matmul__(self, rhs): return mkop('Dot', (self, rhs))
    def __truediv__(self, rhs): return mkop('Div', (self, rhs))
    def __pow__(self, rhs): return mkop('Pow', (self, rhs))
    def __mod__(self, rhs): return mkop('Rem', (self, rhs))
    def __neg__(self): return mkop('Neg', (self,))
    def __invert__(self): return mkop('Not', (self,))
    __not__ = __invert__
    def __and__(self, rhs): return mkop('And', (self, rhs))
    def __or__(self, rhs): return mkop('Or', (self, rhs))
    def __xor__(self, rhs): return mkop('Xor', (self, rhs))
    def __eq__(self, rhs): return mkop('Eq', (self, rhs))
    def __ne__(self, rhs): return mkop('Ne', (self, rhs))
    def __le__(self, rhs): return mkop('Le', (self, rhs))
    def __lt__(self, rhs): return mkop('Lt', (self, rhs))
    def __ge__(self, rhs): return mkop('Ge', (self, rhs))
    def __gt__(self, rhs): return mkop('Gt', (self, rhs))
    def __lshift__(self, rhs): return mkop('ShiftLeft', (self, rhs))
    def __rshift__(self, rhs): return mkop('ShiftRight', (self, rhs))
    __hash__ = object.__hash__

    def reshape(self, sizes, dimensions=None,
                inferred_dimension=None) -> "Op":  # noqa: ARG002 (marks a dynamic size; sizes are static here)
        return mkop('Reshape', (self,), sizes=sizes, dimensions=dimensions)

    def broadcast(self, sizes) -> "Op":
        """Adds leading dimensions of `sizes`."""
        return mkop('Broadcast', (self,), sizes=sizes)

    def broadcast_in_dim(self, sizes, dimensions) -> "Op":
        return mkop('BroadcastInDim', (self,), sizes=sizes, dimensions=dimensions)

    def slice(self, start_indices, limit_indices, strides=None) -> "Op":
        return mkop('Slice', (self,), start_indices=start_indices, limit_indices=limit_indices,
                    strides=strides if strides is not None else [1] * len(start_indices))

    def slice_in_dim(self, start_index, limit_index, dimno, stride=1) -> "Op":
        return mkop('SliceInDim', (self,), start_index=start_index, limit_index=limit_index, dimno=dimno,
                    stride=stride)

    def dynamic_slice(self, start_indices, slice_sizes) -> "Op":
        return mkop('DynamicSlice', (self,), start_indices=start_indices, slice_sizes=slice_sizes)

    def dynamic_update_slice(self, update, start_indices) -> "Op":
        return mkop('DynamicUpdateSlice', (self, update), start_indices=start_indices)

    def gather(self, start_indices, offset_dims, collapsed_slice_dims, start_index_map, index_vector_dim,
               indices_are_sorted=None, slice_sizes=None) -> "Op":
        if slice_sizes is None:
            raise ValueError("gather needs slice_sizes")
        return mkop('Gather', (self, start_indices), offset_dims=offset_dims,
                    collapsed_slice_dims=collapsed_slice_dims, start_index_map=start_index_map,
                    index_vector_dim=index_vector_dim, slice_sizes=slice_sizes,
                    indices_are_sorted=indices_are_sorted)

    def scatter(self, scatter_indices, updates, computation, update_window_dims, inserted_window_dims,
                scatter_dims_to_operand_dims, index_vector_dim, indices_are_sorted=None,
                unique_indices=None) -> "Op":
        scalar = self.shape().as_scalar()
        computation = Op.make_computation('Scatter', computation, (scalar, scalar))
        return mkop('Scatter', (self, scatter_indices, updates), computation=computation,
                    update_window_dims=update_window_dims, inserted_window_dims=inserted_window_dims,
                    scatter_dims_to_operand_dims=scatter_dims_to_operand_dims,
                    index_vector_dim=index_vector_dim, indices_are_sorted=indices_are_sorted,
                    unique_indices=unique_indices)

    def conv(self, kernel, window_strides, feature_group_count=1, batch_group_count=1, padding='valid',
             precision_config=None) -> "Op":
        return mkop('Conv', (self, kernel), window_strides=window_strides, feature_group_count=feature_group_count,
                    batch_group_count=batch_group_count, padding=padding, precision_config=precision_config)

    def conv_with_general_padding(self, kernel, window_strides, padding, feature_group_count=1,
                                  batch_group_count=1, precision_config=None) -> "Op":
        return mkop('ConvWithGeneralPadding', (self, kernel), window_strides=window_strides, padding=padding,
                    feature_group_count=feature_group_count, batch_group_count=batch_group_count,
                    precision_config=precision_config)

    def conv_with_general_dimensions(self, kernel, window_strides, input_batch_dimension, input_feature_dimension,
                                     kernel_input_feature_dimension, kernel_output_feature_dimension,
                                     output_batch_dimension, output_feature_dimension, input_spatial_dimensions,
                                     kernel_spatial_dimensions, output_spatial_dimensions, padding='valid',
                                     feature_group_count=1, batch_group_count=1, precision_config=None) -> "Op":
        return self.conv_general_dilated(
            kernel, window_strides, padding, None, None, input_batch_dimension, input_feature_dimension,
            kernel_input_feature_dimension, kernel_output_feature_dimension, output_batch_dimension,
            output_feature_dimension, input_spatial_dimensions, kernel_spatial_dimensions,
            output_spatial_dimensions, feature_group_count, batch_group_count, precision_config)

    def conv_general(self, kernel, window_strides, padding, input_batch_dimension, input_feature_dimension,
                     kernel_input_feature_dimension, kernel_output_feature_dimension, output_batch_dimension,
                     output_feature_dimension, input_spatial_dimensions, kernel_spatial_dimensions,
                     output_spatial_dimensions, feature_group_count=1, batch_group_count=1,
                     precision_config=None) -> "Op":
        return self.conv_general_dilated(
            kernel, window_strides, padding, None, None, input_batch_dimension, input_feature_dimension,
            kernel_input_feature_dimension, kernel_output_feature_dimension, output_batch_dimension,
            output_feature_dimension, input_spatial_dimensions, kernel_spatial_dimensions,
            output_spatial_dimensions, feature_group_count, batch_group_count, precision_config)

    def conv_general_dilated(self, kernel, window_strides, padding, lhs_dilation, rhs_dilation,
                             input_batch_dimension, input_feature_dimension, kernel_input_feature_dimension,
                             kernel_output_feature_dimension, output_batch_dimension, output_feature_dimension,
                             input_spatial_dimensions, kernel_spatial_dimensions, output_spatial_dimensions,
                             feature_group_count=1, batch_group_count=1, precision_config=None) -> "Op":
        return mkop('ConvGeneralDilated', (self, kernel), window_strides=window_strides, padding=padding,
                    lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                    input_batch_dimension=input_batch_dimension, input_feature_dimension=input_feature_dimension,
                    kernel_input_feature_dimension=kernel_input_feature_dimension,
                    kernel_output_feature_dimension=kernel_output_feature_dimension,
                    output_batch_dimension=output_batch_dimension, output_feature_dimension=output_feature_dimension,
                    input_spatial_dimensions=input_spatial_dimensions,
                    kernel_spatial_dimensions=kernel_spatial_dimensions,
                    output_spatial_dimensions=output_spatial_dimensions, feature_group_count=feature_group_count,
                    batch_group_count=batch_group_count, precision_config=precision_config)

    def cast(self, to_type: str) -> "Op":
        return mkop('Convert', (self,), to_type=to_type)

    def bitcast(self, to_type: str) -> "Op":
        return mkop('BitcastConvert', (self,), to_type=to_type)

    def pad(self, value: "Op", config) -> "Op":
        """config: one (low, high, interior) triple per dimension."""
        return mkop('Pad', (self, value), config=config)

    def max_pool(self, kernel_size, stride, batch_dimension, feature_dimension, spatial_dimensions,
                 padding='valid') -> "Op":
        return mkop('MaxPool', (self,), kernel_size=kernel_size, stride=stride, batch_dimension=batch_dimension,
                    feature_dimension=feature_dimension, spatial_dimensions=spatial_dimensions, padding=padding)

    def reduce(self, init_value, computation, dimensions) -> "Op":
        scalar = self.shape().as_scalar()
        computation = Op.make_computation('Reduce', computation, (scalar, scalar))
        return mkop('Reduce', (self, init_value), computation=computation, dimensions=dimensions)

    def reduce_all(self, init_value, computation) -> "Op":
        scalar = self.shape().as_scalar()
        computation = Op.make_computation('ReduceAll', computation, (scalar, scalar))
        return mkop('ReduceAll', (self, init_value), computation=computation)

    def reduce_window(self, init_value, computation, window_dimensions, window_strides, padding='valid') -> "Op":
        scalar = self.shape().as_scalar()
        computation = Op.make_computation('ReduceWindow', computation, (scalar, scalar))
        return mkop('ReduceWindow', (self, init_value), computation=computation,
                    window_dimensions=window_dimensions, window_strides=window_strides, padding=padding)

    def select(self, true_value, false_value) -> "Op":
        return mkop('Select', (self, true_value, false_value))

    def transpose(self, permutation) -> "Op":
        return mkop('Transpose', (self,), permutation=permutation)

    def triangualr_solve(self, b, left_side=None, lower=None, unit_diagonal=None, transpose_a=None) -> "Op":
        """Solves op(self) x = b (left_side) or x op(self) = b, self triangular."""
        return mkop('TriangularSolve', (self, b), left_side=left_side, lower=lower, unit_diagonal=unit_diagonal,
                    transpose_a=transpose_a)

    triangular_solve = triangualr_solve

    def clamp(self, min_value, max_value) -> "Op":
        return mkop('Clamp', (min_value, self, max_value))

    def get_tuple_element(self, index: int) -> "Op":
        return mkop('GetTupleElement', (self,), index=index)

    def conditional(self, true_operand, false_operand, true_computation, false_computation) -> "Op":
        true_computation = Op.make_computation('CondTrue', true_computation, (true_operand,))
        false_computation = Op.make_computation('CondFalse', false_computation, (false_operand,))
        return mkop('Conditional', (self, true_operand, false_operand), true_computation=true_computation,
                    false_computation=false_computation)

    @classmethod
    def wrap_function(cls, fn: Callable) -> Callable:
        """`fn` taking a tuple parameter as its elements and returning a tuple for a list."""
        def wrapper(*args, **kwargs):
            if len(args) == 1 and args[0].shape().is_tuple():
                arg = args[0]
                args = [arg.get_tuple_element(i) for i in range(arg.shape().tuple_size())]
            result = fn(*args, **kwargs)
            return Op.tuple(result) if isinstance(result, (tuple, list)) else result
        return wrapper

    @classmethod
    def make_computation(cls, name: str, computation, args_or_shapes, **kwargs):
        """A Computation from a Python function of ops (a built one is returned as is)."""
        if not callable(computation) or isinstance(computation, Computation):
            return computation
        shapes = [a if isinstance(a, Shape) else a.shape() for a in args_or_shapes]
        return create_computation(name, Op.wrap_function(computation), shapes, **kwargs)

    def mkconditional(self, ops, true_fn, false_fn, **kwargs) -> "Op":
        """`true_fn(*ops)` if this predicate holds, else `false_fn(*ops)` (`kwargs`: ignored,
        as PyTorch/XLA does; warned once)."""
        _ignored_kwargs("mkconditional", kwargs)
        input_tuple = Op.tuple(ops)
        return self.conditional(input_tuple, input_tuple, true_fn, false_fn)

    def while_loop(self, condition_computation, body_computation) -> "Op":
        condition_computation = Op.make_computation('Condition', condition_computation, (self,))
        body_computation = Op.make_computation('Body', body_computation, (self,))
        return mkop('While', (self,), condition_computation=condition_computation,
                    body_computation=body_computation)

    @classmethod
    def mkwhile(cls, ops, condition_fn, body_fn, **kwargs) -> "Op":
        """The tuple of `ops` transformed by `body_fn(*elements)` while `condition_fn(*elements)`
        (`kwargs`: ignored, as PyTorch/XLA does; warned once)."""
        _ignored_kwargs("mkwhile", kwargs)
        return Op.tuple(ops).while_loop(condition_computation=condition_fn, body_computation=body_fn)

    def get_dimension_size(self, dimension: int) -> "Op":
        return mkop('GetDimensionSize', (self,), dimension=dimension)

    def rev(self, dimensions) -> "Op":
        return mkop('Rev', (self,), dimensions=dimensions)

    def acos(self): return mkop('Acos', (self,))
    def asin(self): return mkop('Asin', (self,))
    def atan(self): return mkop('Atan', (self,))
    def ceil(self): return mkop('Ceil', (self,))
    def cos(self): return mkop('Cos', (self,))
    def cosh(self): return mkop('Cosh', (self,))
    def erf(self): return mkop('Erf', (self,))
    def erfc(self): return mkop('Erfc', (self,))
    def erfinf(self): return mkop('ErfInv', (self,))
    def exp(self): return mkop('Exp', (self,))
    def expm1(self): return mkop('Expm1', (self,))
    def floor(self): return mkop('Floor', (self,))
    def log(self): return mkop('Log', (self,))
    def log1p(self): return mkop('Log1p', (self,))
    def sqrt(self): return mkop('Sqrt', (self,))
    def real(self): return mkop('Real', (self,))
    def imag(self): return mkop('Imag', (self,))
    def clz(self): return mkop('Clz', (self,))
    def conj(self): return mkop('Conj', (self,))
    def rsqrt(self): return mkop('Rsqrt', (self,))
    def sin(self): return mkop('Sin', (self,))
    def sinh(self): return mkop('Sinh', (self,))
    def tan(self): return mkop('Tan', (self,))
    def tanh(self): return mkop('Tanh', (self,))
    def atan2(self, other): return mkop('Atan2', (self, other))
    def max(self, other): return mkop('Max', (self, other))
    def min(self, other): return mkop('Min', (self, other))

    def scalar_like(self, value) -> "Op":
        shape = self.shape()
        return Op.scalar(self.builder(), value, dtype=shape.dtype).broadcast(shape.sizes)

    def zeros_like(self) -> "Op":
        return self.scalar_like(0)

    def ones_like(self) -> "Op":
        return self.scalar_like(1)

    @classmethod
    def tuple(cls, ops, builder: Optional[Builder] = None) -> "Op":
        return mkop('Tuple', list(ops), builder=builder)

    @classmethod
    def concat_in_dim(cls, ops, dimension: int, builder: Optional[Builder] = None) -> "Op":
        return mkop('ConcatInDim', list(ops), builder=builder, dimension=dimension)

    @classmethod
    def call(cls, computation, ops, builder: Optional[Builder] = None) -> "Op":
        computation = Op.make_computation('Call', computation, ops)
        return mkop('Call', list(ops), computation=computation, builder=builder)

    @classmethod
    def constant(cls, builder: Builder, value) -> "Op":
        return mkleaf('Constant', builder, value=value)

    @classmethod
    def scalar(cls, builder: Builder, value, dtype: Optional[str] = None) -> "Op":
        return mkleaf('Constant', builder, value=torch.tensor(value, dtype=cls.to_torch_type(dtype)))

    @classmethod
    def zero(cls, builder: Builder, dtype: Optional[str] = None) -> "Op":
        return cls.scalar(builder, 0, dtype=dtype)

    @classmethod
    def one(cls, builder: Builder, dtype: Optional[str] = None) -> "Op":
        return cls.scalar(builder, 1, dtype=dtype)

    @classmethod
    def iota(cls, builder: Builder, shape: Shape, iota_dimension: int) -> "Op":
        return mkleaf('Iota', builder, shape=shape.shape, iota_dimension=iota_dimension)

    @classmethod
    def map(cls, ops, computation, dimensions, static_operands=(), builder: Optional[Builder] = None) -> "Op":
        """`computation` applied elementwise to `ops` (plus `static_operands` whole)."""
        if not isinstance(computation, Computation):
            scalars = [o.shape().as_scalar() for o in ops] + [o.shape() for o in static_operands]
            computation = Op.make_computation('Map', computation, scalars)
        return mkop('Map', list(ops), builder=builder, computation=computation, dimensions=tuple(dimensions),
                    static_operands=list(static_operands))

    @classmethod
    def to_torch_type(cls, dtype: Optional[str]) -> torch.dtype:
        return _XLA_PT_TYPE_MAP[dtype] if dtype else torch.float32

    @classmethod
    def from_torch_type(cls, dtype: torch.dtype) -> str:
        return _PT_XLA_TYPE_MAP[dtype]

    def __repr__(self):
        return f"Op({self.op.label}, {self.shape().shape})"


def tensor_shape(tensor, device: str = ''):
    """The XLA shape of a tensor (a list of shapes for a list of tensors)."""
    if isinstance(tensor, (list, tuple)):
        return [tensor_shape(t, device) for t in tensor]
    from .._engine import pjrt
    return Shape.create(_xla_type(pjrt.device_dtype(tensor.dtype)) if tensor.device.type == 'xla'
                        else Op.from_torch_type(tensor.dtype), tuple(tensor.shape))




def create_computation(name: str, fn: Callable, shapes: Sequence, **kwargs) -> Computation:
    """Calls `fn(*params, **kwargs)` on one parameter op per shape; builds its result."""
    builder = create_builder(name)
    params = [mkparam(builder, i, s) for i, s in enumerate(shapes)]
    root = fn(*params, **kwargs)
    if isinstance(root, (list, tuple)):
        root = Op.tuple(root, builder=builder)
    return root.build(name)


def get_computation_hlo(computation: Computation) -> str:
    """The computation as HLO text."""
    return computation.hlo_text()


def xla_computation_as_func(computation: Computation, name: Optional[str] = None) -> Callable:
    """A function of a list of xla tensors that applies `computation` to them."""
    name = name or "xla::computation"
    if '::' not in name:
        name = 'xla::' + name

    def fn(input_tensors):
        return user_computation(name, input_tensors, computation)
    return fn


def user_computation(opname: str, inputs: Sequence[torch.Tensor], computation: Computation) -> List[torch.Tensor]:
    """Applies `computation` to xla tensors: one tensor per element of a tuple result."""
    from .._engine import pjrt
    from .._engine.kernels import engine_op
    if not isinstance(computation, Computation):
        raise TypeError(f"expected a Computation, got {type(computation).__name__}")
    inputs = list(inputs)
    if len(inputs) != len(computation.param_shapes):
        raise ValueError(f"{opname}: computation {computation.name} takes {len(computation.param_shapes)} "
                         f"parameters, got {len(inputs)} tensors")
    for i, (t, s) in enumerate(zip(inputs, computation.param_shapes)):
        if t.device.type != 'xla':
            raise RuntimeError(f"{opname}: input {i} is on {t.device}, expected an xla tensor")
        if s.is_tuple() or tuple(t.shape) != tuple(s.sizes) or \
                _xla_type(pjrt.device_dtype(t.dtype)) != s.dtype:
            raise ValueError(f"{opname}: input {i} of shape {tuple(t.shape)} ({t.dtype}) does not match "
                             f"parameter {i} of computation {computation.name}: {s.shape}")
    jax = _jax()
    leaves = jax.tree_util.tree_leaves(_aval_of_shape(computation.result_shape))
    avals = [(tuple(a.shape), pjrt.torch_dtype(a.dtype)) for a in leaves]
    with torch.no_grad():
        return engine_op("xla::user_computation", [t.detach() for t in inputs], (opname, computation), avals)


class XlaCallable(CompiledCallableWithCache):
    """A function written with this module's ops (`Op`), called on xla tensors: each
    tensor argument becomes a parameter op, the result's ops become the outputs of one
    computation, applied to the tensors inside the lazy graph. Other arguments are fixed
    per specialisation."""

    def __init__(self, xla_func: Callable):
        super().__init__(FlattenedInputFunc(xla_func))

    def specialize(self, sample_flat_args: Sequence[torch.Tensor]) -> Callable:
        name = 'xla::computation'
        builder = create_builder(name)
        params = [mkparam(builder, i, tensor_shape(t)) for i, t in enumerate(sample_flat_args)]
        root = Op.tuple(self._flat_input_func.flat_call(params), builder=builder)
        computation = root.build(name)

        def run(tensors):
            return user_computation(name, tensors, computation)
        return run


def create_placeholder_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An xla tensor of `shape` and `dtype` with no device buffer: graphs that read it can
    be printed (`_get_xla_tensors_hlo`), with it as a parameter, without any transfer;
    reading its value raises RuntimeError."""
    return _placeholder(mkshape(Op.from_torch_type(dtype), shape))
