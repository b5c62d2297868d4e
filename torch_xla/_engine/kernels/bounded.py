"""Bounded dynamic shapes (`XLA_EXPERIMENTAL`, docs/dynamic_shapes.md).

An op whose result size depends on data (nonzero, masked_select, torchvision's nms) stays
on the device: its result holds data padded to an upper bound plus, per dynamic
dimension, the real size as a 0-d device value. Such a tensor is a `BoundedTensor` (the
inner tensor under functionalization, like any other xla tensor's): its sizes are
`torch.SymInt`s over a `SizeNode` (printed `<=N`; compared or converted to int, they read
the real size from the device, once). Its `_xla` state is the padded value, so barriers,
dumps and programs see ordinary static shapes and one program serves every real size.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from .. import env_vars, executor, ir, telemetry
from ..mode import modes
from ..lowering import LOWERINGS, bounded as _lowerings  # noqa: F401 (registers the lowerings)
from ..tensor import device_index, make_alias, make_tensor, state_of, unwrap, wrap_user
from . import values
from .bounded_sizes import SizeNode, bound, has_symbolic, real, same_value, size_of, sym
from .op_kernel import to_copy

aten = torch.ops.aten
SWITCHES = ("nonzero", "masked_select", "masked_scatter", "nms")


def enabled(op: str) -> bool:
    """Whether `XLA_EXPERIMENTAL` keeps `op` on the device with a bounded result."""
    return op in env_vars.get("XLA_EXPERIMENTAL").split(":")


def any_enabled() -> bool:
    return any(enabled(op) for op in SWITCHES)


# ---- tensors --------------------------------------------------------------------------------

class BoundedTensor(torch.Tensor):
    """An inner xla tensor with symbolic sizes: `_xla` is the padded value, `bsizes` the
    size of each dimension (an int, or a `SizeNode` whose bound is the padded size)."""

    @staticmethod
    def __new__(cls, state, sizes: Sequence):
        # the padded value's strides: symbolic ones would put size arithmetic on the device
        # at every tensor made
        t = torch.Tensor._make_wrapper_subclass(cls, [sym(s) for s in sizes], strides=_strides(state.shape),
                                                dtype=state.dtype, device=torch.device("xla", device_index()))
        t._xla = state
        t.bsizes = tuple(sizes)
        return t

    def __repr__(self):
        return f"BoundedTensor(sizes={list(self.bsizes)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func) or HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(func, args, kwargs)
        if torch.Tag.pointwise in func.tags:
            return _pointwise(func, args, kwargs)
        return _static_fallback(func, args, kwargs)


def _strides(shape: tuple) -> List[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return out[::-1]


def bounded(padded: torch.Tensor, sizes: Sequence) -> torch.Tensor:
    """A BoundedTensor holding the value of inner tensor `padded` (shaped by the bounds),
    or `padded` itself when every size is static."""
    sizes = tuple(size_of(s) if not isinstance(s, SizeNode) else s for s in sizes)
    if not any(isinstance(s, SizeNode) for s in sizes):
        return padded
    s = state_of(padded)
    out = BoundedTensor(s, sizes)
    ir.mark_bounded(s.node, s.idx, tuple(i for i, v in enumerate(sizes) if isinstance(v, SizeNode)))
    return out


def plain(t):
    """The padded value of a BoundedTensor as a plain inner tensor; anything else unchanged."""
    if type(t) is BoundedTensor:
        return make_alias(t._xla)
    return t


def sizes_of(t: torch.Tensor) -> tuple:
    return t.bsizes if type(t) is BoundedTensor else tuple(t.shape)


def real_value(t: torch.Tensor) -> torch.Tensor:
    """The real part of a BoundedTensor as a plain inner tensor (reads its sizes)."""
    if type(t) is not BoundedTensor:
        return t
    v = plain(t)
    for d, s in enumerate(t.bsizes):
        if isinstance(s, SizeNode) and s.value() != s.bound:
            v = aten.slice_copy.Tensor(v, d, 0, s.value())
    return v


def _tree_map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(fn, v) for v in x)
    return fn(x)


def _static_fallback(func, args, kwargs):
    """Any other op: on the real (static) values, after reading the sizes."""
    telemetry.inc("bounded::" + func.__name__)
    return func(*_tree_map(real_value, args), **{k: _tree_map(real_value, v) for k, v in kwargs.items()})


def _broadcast(shapes: List[tuple]) -> tuple:
    """The broadcast of logical shapes whose dims are ints or SizeNodes: a dynamic size
    broadcasts against 1 or itself only (anything else is PyTorch's RuntimeError)."""
    rank = max(len(s) for s in shapes)
    out = []
    for d in range(rank):
        got = 1
        for k, s in enumerate(shapes):
            i = d - (rank - len(s))
            if i < 0:
                continue
            v = s[i]
            if _is1(v):
                continue
            if _is1(got):
                got = v
                continue
            if isinstance(v, SizeNode) or isinstance(got, SizeNode):
                if isinstance(v, SizeNode) and isinstance(got, SizeNode) and same_value(v, got):
                    continue
            elif v == got:
                continue
            raise RuntimeError(f"The size of tensor a ({got}) must match the size of tensor b ({v}) at "
                               f"non-singleton dimension {d}")
        out.append(got)
    return tuple(out)


def _is1(v) -> bool:
    return not isinstance(v, SizeNode) and v == 1


def _operand(a):
    """`plain(a)`; a dynamic size as a scalar operand (`grad / numel` in mean's backward) is its
    device value (a 0-d tensor), so dividing by it reads nothing."""
    if isinstance(a, torch.SymInt) and isinstance(a.node, SizeNode):
        return a.node.tensor() if a.node.v is not None else a.node.const
    return plain(a)


def _pointwise(func, args, kwargs):
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0
               and a.device.type == "xla"]
    sizes = _broadcast([sizes_of(t) for t in tensors])
    if any(isinstance(a, torch.SymInt) for a in args) and func.overloadpacket is not None:
        # a Scalar overload cannot take the device value: its Tensor overload can
        tensor_op = getattr(func.overloadpacket, "Tensor", None)
        if tensor_op is not None and func._overloadname == "Scalar":
            func = tensor_op
    out = func(*_tree_map(_operand, args), **{k: _tree_map(_operand, v) for k, v in kwargs.items()})
    return _tree_map(lambda o: bounded(o, sizes) if isinstance(o, torch.Tensor) and o.dim() == len(sizes) else o,
                     out)


def _same_sizes(func, args, kwargs):
    """Ops whose result has their first argument's sizes (clone, fill, copies, dtype casts)."""
    x = args[0]
    out = func(*_tree_map(plain, args), **{k: _tree_map(plain, v) for k, v in kwargs.items()})
    return bounded(out, x.bsizes)


def _to_copy(func, args, kwargs):
    x = args[0]
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != "xla":
        return func(real_value(x), **kwargs)
    return _same_sizes(func, args, kwargs)


def _unsqueeze(func, args, kwargs):
    x, dim = args[0], args[1]
    n = x.dim() + 1
    dim = dim + n if dim < 0 else dim
    sizes = list(x.bsizes)
    sizes.insert(dim, 1)
    return bounded(func(plain(x), dim), sizes)


def _permuted(func, args, kwargs, order):
    x = args[0]
    out = func(plain(x), *args[1:], **kwargs)
    return bounded(out, [x.bsizes[i] for i in order])


def _t(func, args, kwargs):
    x = args[0]
    return _permuted(func, args, kwargs, list(range(x.dim()))[::-1])


def _transpose(func, args, kwargs):
    x, a, b = args[0], args[1], args[2]
    order = list(range(x.dim()))
    order[a], order[b] = order[b], order[a]
    return _permuted(func, args, kwargs, order)


def _permute(func, args, kwargs):
    x = args[0]
    order = [d % x.dim() for d in args[1]]
    return _permuted(func, args, kwargs, order)


def _whole(size: SizeNode, start=None, end=None, step=1) -> bool:
    """Whether a slice takes a whole dimension (`x[:]`), whatever its real size."""
    return (start in (None, 0) and step == 1
            and (end is None or (not isinstance(end, torch.SymInt) and end >= size.bound)
                 or (isinstance(end, torch.SymInt) and isinstance(end.node, SizeNode) and same_value(end.node, size))))


def _static_dim(func, args, kwargs):
    """select / slice / unbind along a static dimension: the dynamic sizes stay (along a
    dynamic one the real values are needed: the static fallback)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = dim % x.dim()
    name = func.overloadpacket.__name__
    if isinstance(x.bsizes[dim], SizeNode):
        if name.startswith("slice") and _whole(x.bsizes[dim], *args[2:]):
            return bounded(plain(x), x.bsizes)
        return _static_fallback(func, args, kwargs)
    out = func(plain(x), *args[1:], **kwargs)

    def sizes(o):
        if name.startswith("slice"):
            return [o.shape[d] if d == dim else s for d, s in enumerate(x.bsizes)]
        return [s for d, s in enumerate(x.bsizes) if d != dim]
    if isinstance(out, (list, tuple)):
        return type(out)(bounded(o, sizes(o)) for o in out)
    return bounded(out, sizes(out))


def expand(x: torch.Tensor, size: Sequence) -> torch.Tensor:
    """`x.expand(size)` where `x` or `size` may be bounded."""
    xs = sizes_of(x)
    want = [size_of(s) for s in size]
    if len(want) < len(xs):
        raise RuntimeError(f"expand: the number of sizes provided ({len(want)}) must be greater or equal "
                           f"to the number of dimensions in the tensor ({len(xs)})")
    lead = len(want) - len(xs)
    out = []
    for d, w in enumerate(want):
        if d < lead:
            if not isinstance(w, SizeNode) and w < 0:
                raise RuntimeError(f"The expanded size of the tensor ({w}) isn't allowed in a leading, "
                                   "non-existing dimension 0")
            out.append(w)
            continue
        have = xs[d - lead]
        if not isinstance(w, SizeNode) and w == -1:
            out.append(have)
        elif _is1(have) or (isinstance(have, SizeNode) and isinstance(w, SizeNode) and same_value(have, w)) \
                or (not isinstance(have, SizeNode) and not isinstance(w, SizeNode) and have == w):
            out.append(w)
        else:
            raise RuntimeError(f"The expanded size of the tensor ({w}) must match the existing size ({have}) at "
                               f"non-singleton dimension {d}.  Target sizes: {list(map(str, want))}.  "
                               f"Tensor sizes: {list(map(str, xs))}")
    padded = aten.expand_copy.default(plain(x), [bound(s) for s in out])
    return bounded(padded, out)


def _expand(func, args, kwargs):
    return expand(args[0], args[1])


def view(x: torch.Tensor, size: Sequence) -> torch.Tensor:
    """`x.view(size)` where `x` or `size` may be bounded: the dynamic size must keep its
    place at the front of the row-major order, with the same bound (a static tensor viewed
    with a dynamic size needs real size == bound)."""
    want = [size_of(s) for s in size]
    xs = sizes_of(x)
    dyn_in = type(x) is BoundedTensor
    dyn_out = any(isinstance(s, SizeNode) for s in want)
    if dyn_in and not dyn_out:
        raise RuntimeError(f"view of a tensor with dynamic sizes {list(map(str, xs))} to static sizes "
                           f"{want} is not supported")
    numel_bound = 1
    for s in xs:
        numel_bound *= bound(s)
    if -1 in want:
        raise RuntimeError("view: -1 with dynamic sizes is not supported")
    want_bound = 1
    for s in want:
        want_bound *= bound(s)
    shown = "[" + ", ".join(map(str, want)) + "]"
    if want_bound != numel_bound:
        raise RuntimeError(f"shape '{shown}' is invalid for input of size {numel_bound}")
    if dyn_in:
        # only a leading dynamic dimension keeps its real elements in the padded prefix
        if any(isinstance(s, SizeNode) for s in xs[1:]) or any(isinstance(s, SizeNode) for s in want[1:]):
            raise RuntimeError("view: only the first dimension may be dynamic")
        rest_in = 1
        for s in xs[1:]:
            rest_in *= s
        rest_out = 1
        for s in want[1:]:
            rest_out *= s
        if rest_in != rest_out or (not same_value(xs[0], want[0]) and real(xs[0]) != real(want[0])):
            raise RuntimeError(f"shape '{shown}' is invalid for input of size {real(xs[0]) * rest_in}")
    else:
        got = 1
        for s in want:
            got *= real(s)
        if got != numel_bound:
            raise RuntimeError(f"shape '{shown}' is invalid for input of size {numel_bound}")
    padded = aten.view_copy.default(plain(x), [bound(s) for s in want])
    return bounded(padded, want)


def _view(func, args, kwargs):
    return view(args[0], args[1])


def _reduce(func, args, kwargs):
    """sum / mean / amax / amin over dynamic dimensions: the padding is masked with the
    reduction's neutral element first (mean divides by the real count)."""
    x = args[0]
    name = func.overloadpacket.__name__
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    rank = x.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    dims = [d % rank for d in dims]
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    dyn = [d for d, s in enumerate(x.bsizes) if isinstance(s, SizeNode)]
    if name in ("sum", "mean"):
        fill = 0
    elif x.dtype.is_floating_point:
        fill = float("-inf") if name == "amax" else float("inf")
    else:
        info = torch.iinfo(x.dtype) if x.dtype != torch.bool else None
        fill = (info.min if name == "amax" else info.max) if info else (name == "amin")
    v = mask(x, fill)
    if name == "mean":
        total = aten.sum.dim_IntList(v, dims, keepdim, dtype=kwargs.get("dtype"))
        count = None
        for d in dims:
            s = x.bsizes[d]
            c = s.tensor() if isinstance(s, SizeNode) else s
            count = c if count is None else count * c
        out = total / count
    else:
        out = func(v, dims, keepdim, **({"dtype": kwargs["dtype"]} if kwargs.get("dtype") else {}))
    sizes = [s for d, s in enumerate(x.bsizes) if d not in dims or keepdim]
    if keepdim:
        sizes = [1 if d in dims else s for d, s in enumerate(x.bsizes)]
    left = [d for d in dyn if d not in dims]
    return bounded(out, sizes) if left else out


def mask(x: torch.Tensor, fill) -> torch.Tensor:
    """The padded value of BoundedTensor `x` with `fill` past the real sizes (a plain inner tensor)."""
    dyn = [(d, s) for d, s in enumerate(x.bsizes) if isinstance(s, SizeNode)]
    s = x._xla
    operands = ((s.node, s.idx),) + tuple((state_of(n.tensor()).node, state_of(n.tensor()).idx) for _, n in dyn)
    argv = tuple(ir.ref(i) for i in range(len(operands))) + tuple(d for d, _ in dyn) + (fill,)
    node = ir.Node("xla::bounded_mask", operands, argv, ((s.shape, s.dtype),), LOWERINGS["xla::bounded_mask"])
    telemetry.inc("xla::bounded_mask")
    return make_tensor(node, 0, s.shape, s.dtype)


def _masked_scatter(func, args, kwargs):
    """`masked_scatter(self, mask, source)` (masked_select's gradient) with a dynamic source:
    the op reads as many source elements as the mask holds, which a source made by
    `masked_select` of that mask has in its real prefix; the padded value serves as it is
    (static self and mask are used as they are; dynamic ones are read)."""
    x, m, src = args[0], args[1], args[2]
    if type(x) is BoundedTensor or type(m) is BoundedTensor:
        return _static_fallback(func, args, kwargs)
    return func(x, m, plain(src), **kwargs)


def _reduce_all(func, args, kwargs):
    """The overloads over every dimension (`x.sum()`, `x.mean()`, `x.max()`, `x.min()`)."""
    target = {"sum": aten.sum.dim_IntList, "mean": aten.mean.dim, "max": aten.amax.default,
              "min": aten.amin.default}[func.overloadpacket.__name__]
    return _reduce(target, [args[0], None], kwargs)


HANDLERS: Dict = {
    aten._to_copy.default: _to_copy,
    aten.clone.default: _same_sizes,
    aten.fill.Scalar: _same_sizes,
    aten.fill.Tensor: _same_sizes,
    aten.detach.default: _same_sizes,
    aten.alias.default: _same_sizes,
    aten.alias_copy.default: _same_sizes,
    aten.detach_copy.default: _same_sizes,
    aten.lift_fresh.default: _same_sizes,
    aten.zeros_like.default: _same_sizes,
    aten.ones_like.default: _same_sizes,
    aten.empty_like.default: _same_sizes,
    aten.full_like.default: _same_sizes,
    aten.unsqueeze.default: _unsqueeze,
    aten.unsqueeze_copy.default: _unsqueeze,
    aten.t.default: _t,
    aten.t_copy.default: _t,
    aten.transpose.int: _transpose,
    aten.transpose_copy.int: _transpose,
    aten.permute.default: _permute,
    aten.permute_copy.default: _permute,
    aten.expand.default: _expand,
    aten.expand_copy.default: _expand,
    aten.view.default: _view,
    aten.view_copy.default: _view,
    aten._unsafe_view.default: _view,
    aten.select.int: _static_dim,
    aten.select_copy.int: _static_dim,
    aten.slice.Tensor: _static_dim,
    aten.slice_copy.Tensor: _static_dim,
    aten.unbind.int: _static_dim,
    aten.unbind_copy.int: _static_dim,
    aten.masked_scatter.default: _masked_scatter,
    aten.sum.dim_IntList: _reduce,
    aten.sum.default: _reduce_all,
    aten.mean.default: _reduce_all,
    aten.max.default: _reduce_all,
    aten.min.default: _reduce_all,
    aten.mean.dim: _reduce,
    aten.amax.default: _reduce,
    aten.amin.default: _reduce,
}


# ---- producers ------------------------------------------------------------------------------

def _engine_node(name: str, inputs: Sequence[torch.Tensor], statics: tuple, avals) -> List[torch.Tensor]:
    states = [state_of(t) for t in inputs]
    operands = tuple((s.node, s.idx) for s in states)
    argv = tuple(ir.ref(i) for i in range(len(operands))) + tuple(statics)
    node = ir.Node(name, operands, argv, tuple(avals), LOWERINGS[name], None)
    telemetry.inc(name)
    outs = [make_tensor(node, i, sh, dt) for i, (sh, dt) in enumerate(avals)]
    if modes.eager:
        executor.execute([o._xla for o in outs], metric="EagerOpExecuteTime")
    return outs


def nonzero(x: torch.Tensor) -> torch.Tensor:
    """`torch.nonzero(x)` with a bounded first dimension (x.numel() rows)."""
    x = real_value(x)
    n = x.numel()
    data, count = _engine_node("xla::bounded_nonzero", [x], (), [((n, x.dim()), torch.int64), ((), torch.int64)])
    return bounded(data, [SizeNode.leaf(count, n), x.dim()])


def masked_select(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`torch.masked_select(x, mask)` with a bounded size (the broadcast numel)."""
    if m.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {m.dtype}")
    x, m = real_value(x), real_value(m)
    shape = torch.broadcast_shapes(x.shape, m.shape)
    n = 1
    for s in shape:
        n *= s
    data, count = _engine_node("xla::bounded_masked_select", [x, m], (), [((n,), x.dtype), ((), torch.int64)])
    return bounded(data, [SizeNode.leaf(count, n)])


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision's `nms` with a bounded result (the box count)."""
    boxes, scores = real_value(boxes), real_value(scores)
    n = boxes.shape[0]
    data, count = _engine_node("xla::bounded_nms", [boxes, scores], (float(iou_threshold),),
                               [((n,), torch.int64), ((), torch.int64)])
    return bounded(data, [SizeNode.leaf(count, n)])


def dimension_size(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The size of dimension `dim` of xla tensor `t` as a 0-d int32 user tensor."""
    inner = unwrap(t)
    s = sizes_of(inner)[dim]
    if isinstance(s, SizeNode):
        return wrap_user(to_copy(s.tensor(), torch.int32))
    return wrap_user(values.const_tensor((), torch.int32, int(s)))


# ---- kernels of static tensors given symbolic sizes -------------------------------------------

def _guarded(short: str, original: Callable, handler: Callable) -> Callable:
    """`original` unless a symbolic size of ours is among the arguments."""
    def kernel(*args, **kwargs):
        if has_symbolic(args) or has_symbolic(tuple(kwargs.values())):
            return handler(*args, **kwargs)
        return original(*args, **kwargs)
    kernel.__name__ = "bounded_" + short.replace(".", "_")
    return kernel


def _k_empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    values.check_device(device)
    sizes = [size_of(s) for s in size]
    dtype = dtype or torch.get_default_dtype()
    return wrap_user(bounded(values.const_tensor([bound(s) for s in sizes], dtype, 0), sizes))


def _k_full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    values.check_device(device)
    sizes = [size_of(s) for s in size]
    if dtype is None:
        dtype = torch.get_default_dtype() if isinstance(fill_value, float) else (
            torch.bool if isinstance(fill_value, bool) else torch.int64)
    return wrap_user(bounded(values.const_tensor([bound(s) for s in sizes], dtype, fill_value), sizes))


def _factory(value):
    def k(size, dtype=None, layout=None, device=None, pin_memory=None):
        return _k_full(size, value, dtype or torch.get_default_dtype(), layout, device, pin_memory)
    return k


def _k_new(value):
    def k(x, size, dtype=None, layout=None, device=None, pin_memory=None):
        return bounded(values.const_tensor([bound(size_of(s)) for s in size], dtype or x.dtype, value),
                       [size_of(s) for s in size])
    return k


def _static_new(value) -> Callable:
    def k(x, size, dtype=None, layout=None, device=None, pin_memory=None):
        return aten.full.default(size, value, dtype=dtype or x.dtype, device=device or x.device)
    return k


def _k_arange(original: Callable) -> Callable:
    def k(end, dtype=None, layout=None, device=None, pin_memory=None):
        """`arange(n)` of a dynamic size: the padded arange of its bound."""
        n = size_of(end)
        r = original(bound(n), dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)
        return wrap_user(bounded(unwrap(r), [n]))
    return k


def register(library, kernels: Dict, handwritten: Dict, timed: Callable) -> None:
    """Under `XLA_EXPERIMENTAL`: the producers' kernels, and kernels of the ops that take
    sizes (expand, view, factories) that route symbolic sizes here."""
    from .specialise import specialisable, specialise
    if enabled("nonzero"):
        library.replace("nonzero", nonzero, "PrivateUse1")
    if enabled("masked_select"):
        library.replace("masked_select", masked_select, "PrivateUse1")
    if enabled("nms"):
        _register_nms(library)

    def entry(name):
        k = kernels[name]
        if specialisable(k):
            if k.fast is None:
                k.fast = specialise(k)
            return k.fast
        return k

    for name, handler in (("expand_copy.default", lambda x, size, implicit=False: expand(x, size)),
                          ("expand.default", lambda x, size, implicit=False: expand(x, size)),
                          ("view_copy.default", view), ("view.default", view), ("_unsafe_view.default", view),
                          ("zeros.default", _factory(0)), ("ones.default", _factory(1)), ("full.default", _k_full)):
        short = name[:-len(".default")]
        if name in kernels:
            library.replace(short, _guarded(short, entry(name), handler), "PrivateUse1")
    # PyTorch's composite kernels of `new_*` would refuse symbolic sizes: static calls make
    # the factory's tensor, as those kernels do
    for short, value in (("new_empty", 0), ("new_zeros", 0), ("new_ones", 1)):
        library.replace(short, _guarded(short, _static_new(value), _k_new(value)), "PrivateUse1")
    if "arange.default" in kernels:
        original = entry("arange.default")
        library.replace("arange", _guarded("arange", original, _k_arange(original)), "PrivateUse1")
    library.replace("empty.memory_format", _guarded("empty.memory_format", timed(handwritten["empty.memory_format"]),
                                                    _k_empty), "PrivateUse1")


def _register_nms(library) -> None:
    try:
        import torchvision  # noqa: F401 (defines torchvision::nms)
    except ImportError:
        return
    library.impl_foreign("torchvision", "nms", nms, "PrivateUse1")
