"""Indexing: advanced indexing (`index`, `index_put`), gather/scatter, the index_* family,
masked_scatter, take/put.

Index values are data: they cannot be checked at trace time. Negative indices wrap as
in PyTorch (jax's indexing normalises them). Each op records a device-side range check
of its indices (`check_range`, with the exception and message the CPU raises); the
executor raises it after the program ran (`executor/checks.py`). With the checks off
(`XLA_CHECK_INDICES=0`) out-of-range indices read clamped values and scatters drop them.

Boolean masks make shapes data dependent: `x[mask]` (aten::index with a bool index)
runs on the CPU fallback, since PyTorch's meta kernel refuses it. `x[mask] = v`
(index_put with a bool index) keeps the shape of x and is lowered when v is a single
value or broadcasts along the selected dimension (a `where`), or when v carries the
number of selected elements (then that count is static).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .table import check_range, lowering, out_shape


def _dim(d, n):
    return d + n if d < 0 else d


def _is_bool(a):
    return a is not None and a.dtype in (jnp.bool_, jnp.uint8)


def _full_index(indices, ndim):
    """PyTorch's index list (None = whole dim, may be short) as a numpy-style tuple."""
    idx = [slice(None) if i is None else i for i in indices]
    return tuple(idx) + (slice(None),) * (ndim - len(idx))


# ---- index / index_put ---------------------------------------------------------------------

_OOB = "index {value} is out of bounds for dimension %d with size %d"


def _check_indices(x, indices):
    d = 0
    for i in indices:
        if i is not None and _is_bool(i):
            d += max(i.ndim, 1)  # a mask covers as many dimensions as it has
            continue
        if i is not None and d < x.ndim:
            check_range(i, x.shape[d], IndexError, _OOB % (d, x.shape[d]))
        d += 1


@lowering("aten::_unsafe_index.Tensor", "aten::_unsafe_index.Tensor_hacked_twin")
def unsafe_index(x, indices):
    if x.ndim == 0:
        return x
    return x[_full_index(indices, x.ndim)]


@lowering("aten::index.Tensor", "aten::index.Tensor_hacked_twin", checked=True)
def index(x, indices):
    if math.prod(out_shape()) > 0:   # the CPU checks only the indices it reads
        _check_indices(x, indices)
    return unsafe_index(x, indices)


def _bool_index_put(x, indices, values, accumulate):
    """index_put with a bool/uint8 mask among the indices."""
    pos = [i for i, a in enumerate(indices) if a is not None]
    bpos = [i for i in pos if _is_bool(indices[i])]
    # Turn each mask into integer index arrays when the number of selected elements is
    # known from values; otherwise (values broadcast over it) use a select.
    if len(pos) == 1:
        p = pos[0]
        mask = indices[p].astype(bool)
        k = mask.ndim
        rest = x.shape[p + k:]
        rlen = p + 1 + len(rest)  # rank of x[mask]
        cdim = rlen - p            # the count dim, counted from the right
        vshape = jnp.shape(values)
        if len(vshape) < cdim or vshape[len(vshape) - cdim] == 1:
            r_shape = x.shape[:p] + (1,) + rest
            v = jnp.broadcast_to(jnp.asarray(values).astype(x.dtype), r_shape)
            v = jnp.reshape(v, x.shape[:p] + (1,) * k + rest)
            m = jnp.reshape(mask, (1,) * p + mask.shape + (1,) * len(rest))
            if accumulate:
                return x + jnp.where(m, v, jnp.zeros((), x.dtype))
            return jnp.where(m, v, x)
    new = list(indices)
    for p in bpos:
        mask = indices[p].astype(bool)
        # the count: values' extent along the result dim of this mask
        first = pos[0]
        rest_after = x.ndim - (first + sum(indices[i].ndim if _is_bool(indices[i]) else 1 for i in pos))
        vshape = jnp.shape(values)
        cdim = rest_after + 1
        count = vshape[len(vshape) - cdim] if len(vshape) >= cdim else 1
        nz = jnp.nonzero(mask, size=count, fill_value=0)
        new[p:p + 1] = list(nz)
    return _index_put_int(x, tuple(new), values, accumulate)


def _index_put_int(x, indices, values, accumulate):
    idx = _full_index(indices, x.ndim)
    v = jnp.asarray(values).astype(x.dtype)
    ref = x.at[idx]
    return _accumulate(ref, v) if accumulate else ref.set(v)


def _accumulate(ref, v):
    """`ref.add(v)` of a jax `.at[]` reference; a bool sum is a logical or (XLA has no
    bool scatter-add)."""
    return ref.max(v) if v.dtype == jnp.bool_ else ref.add(v)


@lowering("aten::index_put", "aten::index_put.hacked_twin", checked=True)
def index_put(x, indices, values, accumulate=False):
    _check_indices(x, indices)
    return unsafe_index_put(x, indices, values, accumulate)


@lowering("aten::_unsafe_index_put", "aten::_unsafe_index_put.hacked_twin")
def unsafe_index_put(x, indices, values, accumulate=False):
    if x.ndim == 0:
        v = jnp.reshape(jnp.asarray(values).astype(x.dtype), ())
        if any(_is_bool(a) for a in indices):
            m = jnp.reshape([a for a in indices if a is not None][0], ()).astype(bool)
            return jnp.where(m, x + v if accumulate else v, x)
        return x + v if accumulate else v
    if any(_is_bool(a) for a in indices):
        return _bool_index_put(x, indices, values, accumulate)
    return _index_put_int(x, indices, values, accumulate)


@lowering("aten::_index_put_impl", checked=True)
def index_put_impl(x, indices, values, accumulate=False, unsafe=False):
    if not unsafe:
        _check_indices(x, indices)
    return unsafe_index_put(x, indices, values, accumulate)


# ---- gather / scatter ----------------------------------------------------------------------

def _coords(index, dim):
    """Full coordinates of every element of `index` with `index` itself along dim."""
    shape = index.shape
    out = []
    for d in range(len(shape)):
        if d == dim:
            out.append(index)
        else:
            out.append(lax.broadcasted_iota(jnp.int64, shape, d))
    return tuple(out)


def _check_along(x, dim, index, exc=RuntimeError, message=_OOB):
    d = _dim(dim, max(x.ndim, 1))
    size = x.shape[d] if x.ndim else 1
    check_range(index, size, exc, message % (d, size) if "%" in message else message, nonneg=True)


@lowering("aten::gather", checked=True)
def gather(x, dim, index, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    _check_along(x, dim, index)
    scalar = x.ndim == 0 or index.ndim == 0
    if scalar:
        x, index = jnp.reshape(x, (-1,)), jnp.reshape(index, (-1,))
        dim = 0
    dim = _dim(dim, x.ndim)
    # The index may be smaller than x on the other dims: only that corner is read.
    sl = tuple(slice(0, index.shape[d]) if d != dim else slice(None) for d in range(x.ndim))
    out = jnp.take_along_axis(x[sl], index.astype(jnp.int64), axis=dim, mode="clip")
    return jnp.reshape(out, out_shape()) if scalar else out


def _scatter_prep(x, dim, index, src):
    if x.ndim == 0:
        x1 = jnp.reshape(x, (1,))
        idx = jnp.reshape(index, (1,))
        s = src if jnp.ndim(src) == 0 else jnp.reshape(src, (-1,))
        return x1, 0, idx, s, True
    if index.ndim == 0:  # one element: a 1-element index along dim
        index = jnp.reshape(index, (1,) * x.ndim)
        if jnp.ndim(src) != 0:
            src = jnp.reshape(src, (1,) * x.ndim)
    return x, _dim(dim, x.ndim), index, src, False


def _src_part(src, index, dt):
    src = jnp.asarray(src)
    if src.ndim == 0:
        return src.astype(dt)
    sl = tuple(slice(0, n) for n in index.shape)
    return src[sl].astype(dt)


# The reductions of scatter_reduce / index_reduce and the legacy scatter(reduce=...) as
# jax's `.at[]` updates; bool keeps PyTorch's logical or / and.
_AT_OP = {"sum": "add", "add": "add", "mean": "add", "prod": "multiply", "multiply": "multiply",
          "amax": "max", "amin": "min"}
_AT_OP_BOOL = {"add": "max", "multiply": "min"}


def _identity(reduce, dt):
    if reduce in ("sum", "mean"):
        return jnp.zeros((), dt)
    if reduce == "prod":
        return jnp.ones((), dt)
    if jnp.issubdtype(dt, jnp.floating):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dt)
    if dt == jnp.bool_:
        return jnp.asarray(reduce != "amax", dt)
    info = jnp.iinfo(dt)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dt)


def _reduce_at(x, where, v, reduce, count=None, include_self=True):
    """`x` with the values `v` combined into the elements `x[where]` by `reduce`.

    `count` (how many values land on each element of x, broadcastable to it) is needed
    when include_self is false (the elements hit start from the reduction's identity)
    and for "mean"."""
    dt = x.dtype
    if not include_self:
        x = jnp.where(count > 0, _identity(reduce, dt), x)
    op = _AT_OP[reduce]
    if dt == jnp.bool_:
        op = _AT_OP_BOOL.get(op, op)
    out = getattr(x.at[where], op)(v)
    if reduce == "mean":
        n = jnp.maximum(count + 1 if include_self else count, 1).astype(dt)
        out = out / n if jnp.issubdtype(dt, jnp.inexact) else jnp.floor_divide(out, n)
    return out


def _scatter(x, dim, index, src, mode):
    if index.size == 0:
        return x
    _check_along(x, dim, index)
    x1, dim, index, src, scalar = _scatter_prep(x, dim, index, src)
    c = _coords(index.astype(jnp.int64), dim)
    v = _src_part(src, index, x1.dtype)
    out = x1.at[c].set(v) if mode == "set" else _reduce_at(x1, c, v, mode)
    return jnp.reshape(out, x.shape) if scalar else out


@lowering("aten::scatter.src", "aten::scatter.value", checked=True)
def scatter(x, dim, index, src):
    return _scatter(x, dim, index, src, "set")


# PyTorch's meta kernel checks `reduce` ("add" / "multiply").
@lowering("aten::scatter.reduce", "aten::scatter.value_reduce", checked=True)
def scatter_reduce_legacy(x, dim, index, src, reduce):
    return _scatter(x, dim, index, src, reduce)


@lowering("aten::scatter_add", checked=True)
def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, "add")


def _meta_scatter_reduce(x, dim, index, src, reduce, include_self=True):
    """PyTorch's meta kernel after the CPU's refusal of a bool mean (as a RuntimeError: a
    NotImplementedError here would mean "no meta kernel" and send the op to the fallback)."""
    import torch
    if reduce == "mean" and x.dtype == torch.bool:
        raise RuntimeError("\"scatter_gather_tensor_cpu_reduce_mean\" not implemented for 'Bool'")
    return torch.ops.aten.scatter_reduce.two(x, dim, index, src, reduce, include_self=include_self)


@lowering("aten::scatter_reduce.two", checked=True, meta=_meta_scatter_reduce)
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if index.size == 0:
        return x
    _check_along(x, dim, index)
    x1, d, idx, s, scalar = _scatter_prep(x, dim, index, src)
    c = _coords(idx.astype(jnp.int64), d)
    v = _src_part(s, idx, x1.dtype)
    count = jnp.zeros(x1.shape, jnp.int64).at[c].add(1) if reduce == "mean" or not include_self else None
    out = _reduce_at(x1, c, v, reduce, count, include_self)
    return jnp.reshape(out, x.shape) if scalar else out


# ---- index_select / index_add / index_copy / index_fill ------------------------------------

def _along(ndim, dim, index):
    idx = [slice(None)] * ndim
    idx[dim] = jnp.reshape(index, (-1,))
    return tuple(idx)


_SELF = "index out of range in self"


@lowering("aten::index_select", checked=True)
def index_select(x, dim, index):
    _check_along(x, dim, index, IndexError, _SELF)
    if x.ndim == 0:
        return jnp.reshape(x, out_shape())
    dim = _dim(dim, x.ndim)
    return jnp.take(x, jnp.reshape(index, (-1,)), axis=dim, mode="clip")


def _index_update(x, dim, index, source, op):
    if x.ndim == 0:
        s = jnp.reshape(jnp.asarray(source), ()).astype(x.dtype)
        return x + s if op == "add" else s
    dim = _dim(dim, x.ndim)
    src = jnp.asarray(source)
    if src.ndim == 0 and op != "fill":
        src = jnp.reshape(src, (1,) * x.ndim)
    ref = x.at[_along(x.ndim, dim, index)]
    src = src.astype(x.dtype)
    return _accumulate(ref, src) if op == "add" else ref.set(src)


@lowering("aten::index_add", checked=True)
def index_add(x, dim, index, source, alpha=1):
    _check_along(x, dim, index, IndexError, _SELF)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        source = source * jnp.asarray(alpha).astype(source.dtype)
    return _index_update(x, dim, index, source, "add")


@lowering("aten::index_copy", checked=True)
def index_copy(x, dim, index, source):
    _check_along(x, dim, index, IndexError, "index_copy_(): " + _OOB)
    return _index_update(x, dim, index, source, "set")


@lowering("aten::index_fill.int_Scalar", "aten::index_fill.int_Tensor", checked=True)
def index_fill(x, dim, index, value):
    d = _dim(dim, max(x.ndim, 1))
    size = x.shape[d] if x.ndim else 1
    check_range(index, size, IndexError, _OOB % (d, size))
    return _index_update(x, dim, index, jnp.asarray(value).astype(x.dtype), "fill")


# ---- masked_scatter ------------------------------------------------------------------------

@lowering("aten::masked_scatter")
def masked_scatter(x, mask, source):
    shape = out_shape()
    xb = jnp.broadcast_to(x, shape).reshape(-1)
    m = jnp.broadcast_to(mask, shape).reshape(-1).astype(bool)
    src = jnp.reshape(source, (-1,)).astype(xb.dtype)
    if src.size == 0:
        return jnp.reshape(xb, shape)
    pos = jnp.cumsum(m.astype(jnp.int64)) - 1
    vals = jnp.take(src, jnp.clip(pos, 0, src.size - 1))
    return jnp.reshape(jnp.where(m, vals, xb), shape)


@lowering("aten::masked_scatter_backward")
def masked_scatter_backward(grad, mask, sizes):
    sizes = tuple(sizes)
    n = int(np.prod(sizes)) if sizes else 1
    m = jnp.broadcast_to(mask, grad.shape).reshape(-1).astype(bool)
    pos = jnp.cumsum(m.astype(jnp.int64)) - 1
    target = jnp.where(m, pos, n)  # unselected elements go out of range: dropped
    out = jnp.zeros((n,), grad.dtype).at[target].add(jnp.reshape(grad, (-1,)), mode="drop")
    return jnp.reshape(out, sizes)


# ---- take / put ----------------------------------------------------------------------------

_TAKE = "out of range: tried to access index {value} on a tensor of %d elements."


@lowering("aten::take", checked=True)
def take(x, index):
    check_range(index, x.size, IndexError, _TAKE % x.size)
    flat = jnp.reshape(x, (-1,))
    return flat[index]


@lowering("aten::put", checked=True)
def put(x, index, source, accumulate=False):
    check_range(index, x.size, IndexError, _TAKE % x.size)
    flat = jnp.reshape(x, (-1,))
    i = jnp.reshape(index, (-1,))
    s = jnp.reshape(source, (-1,)).astype(x.dtype)
    out = _accumulate(flat.at[i], s) if accumulate else flat.at[i].set(s)
    return jnp.reshape(out, x.shape)


# take_along_dim and index_select_backward are CompositeImplicitAutograd (they decompose
# into gather / index_add): a backend kernel for them would hide their autograd formula.


# ---- searchsorted / bucketize --------------------------------------------------------------

def _binary_search(seq, vals, right, sorter=None):
    """PyTorch's CPU binary search, step for step (so NaNs land where the CPU puts them):
    lower bound moves right while !(seq[mid] >= v), upper bound while !(seq[mid] > v).
    seq (..., M) with the leading dims of vals (..., K), or 1-D."""
    m = seq.shape[-1]
    if seq.ndim == 1:
        seq = jnp.broadcast_to(seq, vals.shape[:-1] + (m,)) if vals.ndim else seq
        if sorter is not None and vals.ndim:
            sorter = jnp.broadcast_to(sorter, vals.shape[:-1] + (m,))
    scalar = vals.ndim == 0
    if scalar:
        vals = jnp.reshape(vals, (1,))
    if seq.dtype != vals.dtype:
        dt = jnp.promote_types(seq.dtype, vals.dtype)
        seq, vals = seq.astype(dt), vals.astype(dt)
    start = jnp.zeros(vals.shape, jnp.int64)
    end = jnp.full(vals.shape, m, jnp.int64)
    if m == 0:
        return start[0] if scalar else start
    for _ in range(int(m).bit_length() + 1):
        active = start < end
        mid = start + ((end - start) >> 1)
        midc = jnp.minimum(mid, m - 1)
        pos = midc if sorter is None else jnp.take_along_axis(sorter.astype(jnp.int64), midc, axis=-1)
        mv = jnp.take_along_axis(seq, pos, axis=-1)
        go_right = ~(mv > vals) if right else ~(mv >= vals)
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start[0] if scalar else start


@lowering("aten::searchsorted.Tensor", "aten::searchsorted.Scalar")
def searchsorted(seq, x, out_int32=False, right=False, side=None, sorter=None):
    r = right or side == "right"
    return _binary_search(seq, jnp.asarray(x), r, sorter)


def _bucketize_meta(x, boundaries, out_int32=False, right=False):
    """PyTorch's meta kernel does not check the boundaries' rank; the CPU does."""
    import torch
    if boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")
    shape = x.shape if isinstance(x, torch.Tensor) else ()
    return torch.empty(shape, dtype=torch.int32 if out_int32 else torch.int64, device="meta")


@lowering("aten::bucketize.Tensor", "aten::bucketize.Scalar", meta=_bucketize_meta)
def bucketize(x, boundaries, out_int32=False, right=False):
    x = jnp.asarray(x)
    flat = jnp.reshape(x, (-1,))
    return jnp.reshape(_binary_search(boundaries, flat, right), x.shape)


# ---- index_reduce / nonzero_static / histc ---------------------------------------------------

def _meta_index_reduce(x, dim, index, source, reduce, include_self=True):
    """PyTorch's meta kernel after the CPU's check of `reduce` (the meta kernel has none)."""
    import torch
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise RuntimeError(f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got {reduce}.")
    return torch.ops.aten.index_reduce(x, dim, index, source, reduce, include_self=include_self)


@lowering("aten::index_reduce", checked=True, meta=_meta_index_reduce)
def index_reduce(x, dim, index, source, reduce, include_self=True):
    """Rows `index[i]` of x along dim combined with slice i of source (as scatter_reduce;
    without include_self the rows that are hit start from the reduction's identity)."""
    _check_along(x, dim, index, IndexError, _SELF)
    scalar = x.ndim == 0
    x1 = jnp.reshape(x, (1,)) if scalar else jnp.moveaxis(x, _dim(dim, x.ndim), 0)
    src = jnp.asarray(source)
    s1 = jnp.reshape(src, (1,)) if src.ndim == 0 else jnp.moveaxis(src, _dim(dim, src.ndim), 0)
    idx = jnp.reshape(index, (-1,)).astype(jnp.int64)
    count = None
    if reduce == "mean" or not include_self:
        count = jnp.zeros((x1.shape[0],), jnp.int64).at[idx].add(1)
        count = jnp.reshape(count, (-1,) + (1,) * (x1.ndim - 1))
    out = _reduce_at(x1, idx, s1.astype(x1.dtype), reduce, count, include_self)
    return jnp.reshape(out, ()) if scalar else jnp.moveaxis(out, 0, _dim(dim, x.ndim))


@lowering("aten::nonzero_static")
def nonzero_static(x, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    nz = jnp.nonzero(x != 0 if x.dtype != jnp.bool_ else x, size=size, fill_value=fill_value)
    return jnp.stack([a.astype(jnp.int64) for a in nz], axis=1) if nz else jnp.zeros((size, 0), jnp.int64)


@lowering("aten::histc")
def histc(x, bins=100, min=0, max=0):
    """The CPU's linear-interpolation binning: bin = trunc((v - lo) * bins / (hi - lo)) in
    the input dtype, v == hi in the last bin, values outside [lo, hi] (and NaNs) dropped.
    min == max means the data's range; an empty range widens to [lo - 1, hi + 1]."""
    dt = x.dtype
    flat = jnp.reshape(x, (-1,))
    lo = jnp.asarray(min).astype(jnp.float64)
    hi = jnp.asarray(max).astype(jnp.float64)
    if flat.size:
        same = lo == hi
        lo = jnp.where(same, jnp.min(flat).astype(jnp.float64), lo)
        hi = jnp.where(same, jnp.max(flat).astype(jnp.float64), hi)
    same = lo == hi
    lo = jnp.where(same, lo - 1, lo).astype(dt)
    hi = jnp.where(same, hi + 1, hi).astype(dt)
    pos = (((flat - lo) * jnp.asarray(bins, dt)) / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    inside = (flat >= lo) & (flat <= hi)
    pos = jnp.where(inside, pos, bins)  # out of range: dropped by the scatter
    counts = jnp.zeros((bins,), jnp.int64).at[pos].add(1, mode="drop")
    return counts.astype(dt)


# ---- embedding_bag ---------------------------------------------------------------------------

def _bag_ids(indices, offsets, include_last_offset):
    """The bag of every index position (num_bags = not in any bag) and the bag count."""
    n = indices.shape[0]
    offsets = offsets.astype(jnp.int64)
    nb = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    ends = offsets[1:nb + 1]
    if not include_last_offset:
        ends = jnp.concatenate([ends, jnp.full((1,), n, jnp.int64)])
    p = jnp.arange(n, dtype=jnp.int64)
    ids = jnp.sum(ends[:, None] <= p[None, :], axis=0)
    ids = jnp.where(p >= offsets[0], ids, nb) if nb else ids
    return ids, nb


@lowering("aten::_embedding_bag", "aten::_embedding_bag_forward_only", checked=True)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """(output, offset2bag, bag_size, max_indices). Indices equal to padding_idx take no
    part (nor in a bag's size); empty bags are 0 in every mode."""
    check_range(indices, weight.shape[0], RuntimeError,
                "Index {pos} of input takes value {value} which is not in the valid range [0, %d)"
                % weight.shape[0], nonneg=True)
    idx = jnp.reshape(indices, (-1,)).astype(jnp.int64)
    ids, nb = _bag_ids(idx, offsets, include_last_offset)
    d = weight.shape[1]
    calc = jnp.float32 if np.dtype(weight.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) else weight.dtype
    rows = jnp.take(weight, idx, axis=0, mode="clip").astype(calc)
    valid = ids < nb
    if padding_idx is not None and padding_idx >= 0:
        valid = valid & (idx != padding_idx)
    tgt = jnp.where(valid, ids, nb)
    count = jnp.zeros((nb + 1,), jnp.int64).at[tgt].add(1)[:nb]
    zero = jnp.zeros((), calc)
    max_idx = jnp.zeros(out_shape(3), jnp.int64)
    if mode == 2:
        vals = jnp.where(valid[:, None], rows, jnp.asarray(-jnp.inf, calc))
        best = jnp.full((nb + 1, d), -jnp.inf, calc).at[tgt].max(vals)
        # the first position holding the maximum (the CPU keeps the first on ties)
        hit = valid[:, None] & (rows == best[tgt])
        pos = jnp.where(hit, jnp.arange(idx.shape[0], dtype=jnp.int64)[:, None], idx.shape[0])
        first = jnp.full((nb + 1, d), idx.shape[0], jnp.int64).at[tgt].min(pos)[:nb]
        max_idx = jnp.where(count[:, None] > 0, jnp.take(idx, jnp.minimum(first, max(idx.shape[0] - 1, 0))), -1)
        out = jnp.where(count[:, None] > 0, best[:nb], zero)
    else:
        if per_sample_weights is not None:
            rows = rows * jnp.reshape(per_sample_weights, (-1, 1)).astype(calc)
        out = jnp.zeros((nb + 1, d), calc).at[tgt].add(jnp.where(valid[:, None], rows, zero))[:nb]
        if mode == 1:
            out = out / jnp.maximum(count, 1)[:, None].astype(calc)
    nbs = out_shape(2)[0]  # with include_last_offset the CPU's bag_size has len(offsets) entries
    count = jnp.pad(count, (0, nbs - nb)) if nbs > nb else count[:nbs]
    return out, ids, count, max_idx


@lowering("aten::_embedding_bag_backward", "aten::_embedding_bag_dense_backward")
def embedding_bag_backward(grad, indices, *args):
    """Both overloads (the dense one has no `offsets`); rows of grad go back to the weight
    rows their bag read (max: only the row that gave each maximum)."""
    if len(args) >= 10:  # _embedding_bag_backward: offsets comes first, `sparse` is extra
        (_, offset2bag, bag_size, max_idx, num_weights, scale_grad_by_freq, mode, _sparse,
         per_sample_weights, *rest) = args
    else:
        offset2bag, bag_size, max_idx, num_weights, scale_grad_by_freq, mode, per_sample_weights, *rest = args
    padding_idx = rest[0] if rest else -1
    dt = grad.dtype
    d = grad.shape[1]
    nb = grad.shape[0]
    idx = jnp.reshape(indices, (-1,)).astype(jnp.int64)
    if mode == 2:
        m = jnp.reshape(max_idx, (nb, d)).astype(jnp.int64)
        m = jnp.where(m < 0, num_weights, m)  # empty bags: dropped
        cols = jnp.broadcast_to(jnp.arange(d), (nb, d))
        return jnp.zeros((num_weights, d), dt).at[m, cols].add(grad, mode="drop")
    ids = offset2bag.astype(jnp.int64)
    valid = ids < nb
    if padding_idx is not None and padding_idx >= 0:
        valid = valid & (idx != padding_idx)
    g = jnp.take(grad, jnp.minimum(ids, nb - 1), axis=0)
    if mode == 1:
        g = g / jnp.maximum(jnp.take(bag_size, jnp.minimum(ids, nb - 1)), 1)[:, None].astype(dt)
    if per_sample_weights is not None:
        g = g * jnp.reshape(per_sample_weights, (-1, 1)).astype(dt)
    if scale_grad_by_freq:
        # The CPU kernel divides the k-th distinct index (ascending) by the frequency of
        # sorted_indices[k], not of the index itself; reproduced to match its gradients.
        freq = jnp.zeros((num_weights,), jnp.int64).at[idx].add(1)
        srt = jnp.sort(idx)
        first = jnp.concatenate([jnp.ones((1,), bool), srt[1:] != srt[:-1]])
        k = jnp.sum(first[None, :] & (srt[None, :] < idx[:, None]), axis=1)
        g = g / jnp.take(freq, jnp.take(srt, k))[:, None].astype(dt)
    g = jnp.where(valid[:, None], g, jnp.zeros((), dt))
    return jnp.zeros((num_weights, d), dt).at[idx].add(g)


@lowering("aten::_embedding_bag_per_sample_weights_backward")
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    idx = jnp.reshape(indices, (-1,)).astype(jnp.int64)
    nb = grad.shape[0]
    ids = offset2bag.astype(jnp.int64)
    valid = ids < nb
    if padding_idx is not None and padding_idx >= 0:
        valid = valid & (idx != padding_idx)
    g = jnp.take(grad, jnp.minimum(ids, nb - 1), axis=0)
    w = jnp.take(weight, idx, axis=0, mode="clip").astype(g.dtype)
    return jnp.where(valid, jnp.sum(g * w, axis=1), jnp.zeros((), g.dtype))


# ---- histogram / histogramdd ---------------------------------------------------------------
# The CPU's kernels: edges from the range (or the data's, widened by 0.5 when empty) as
# linspace computes them in the input dtype; an element lands in the last edge not above
# it, the rightmost edge in the last bin, elements outside the edges (and NaNs) nowhere.

def _linspace_cpu(lo, hi, steps, dt):
    """torch.linspace as the CPU computes it: from the start for the first half, from the
    end for the second, with the step in the output dtype."""
    lo, hi = lo.astype(dt), hi.astype(dt)
    if steps == 1:
        return jnp.reshape(lo, (1,))
    step = (hi - lo) / jnp.asarray(steps - 1, dt)
    i = jnp.arange(steps)
    fi = i.astype(dt)
    return jnp.where(i < steps // 2, lo + step * fi, hi - step * jnp.asarray(steps - 1 - i, dt))


def _hist_edges(x2, bins, rng):
    """Edges of every dim of the (M, D) samples for bin counts `bins`."""
    edges = []
    for d, n in enumerate(bins):
        if rng is not None:
            lo, hi = jnp.asarray(rng[2 * d], jnp.float64), jnp.asarray(rng[2 * d + 1], jnp.float64)
        elif x2.shape[0]:
            lo, hi = jnp.min(x2[:, d]).astype(jnp.float64), jnp.max(x2[:, d]).astype(jnp.float64)
        else:
            lo = hi = jnp.zeros((), jnp.float64)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(_linspace_cpu(lo, hi, n + 1, x2.dtype))
    return edges


def _hist_counts(x2, edges, weight, density):
    dt = x2.dtype
    nb = [e.shape[0] - 1 for e in edges]
    flat = jnp.zeros((x2.shape[0],), jnp.int64)
    keep = jnp.ones((x2.shape[0],), bool)
    for d, e in enumerate(edges):
        v = x2[:, d]
        pos = jnp.searchsorted(e, v, side="right").astype(jnp.int64) - 1
        pos = jnp.where(pos == nb[d], nb[d] - 1, pos)
        keep = keep & (v >= e[0]) & (v <= e[-1])
        flat = flat * nb[d] + jnp.clip(pos, 0, max(nb[d] - 1, 0))
    total = int(np.prod(nb))
    w = jnp.ones((x2.shape[0],), dt) if weight is None else jnp.reshape(weight, (-1,)).astype(dt)
    w = jnp.where(keep, w, jnp.zeros((), dt))
    hist = jnp.zeros((total,), dt).at[flat].add(w, mode="drop") if total else jnp.zeros((0,), dt)
    hist = jnp.reshape(hist, tuple(nb))
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            shape = [1] * len(nb)
            shape[d] = nb[d]
            hist = hist / jnp.reshape(e[1:] - e[:-1], shape)
    return hist


def _meta_histogram(x, bins=100, range=None, weight=None, density=False):
    return x.new_empty((bins,)), x.new_empty((bins + 1,))


@lowering("aten::histogram.bin_ct", static=("bins", "range"), meta=_meta_histogram)
def histogram_bin_ct(x, bins=100, range=None, weight=None, density=False):
    x2 = jnp.reshape(x, (-1, 1))
    edges = _hist_edges(x2, (bins,), range)
    return _hist_counts(x2, edges, weight, density), edges[0]


def _meta_histogram_bins(x, bins, weight=None, density=False):
    if bins.dim() != 1:
        raise RuntimeError(f"torch.histogramdd: bins tensor should have one dimension, but got {bins.dim()} "
                           "dimensions in the bins tensor for dimension 0")
    return x.new_empty((bins.shape[0] - 1,)), x.new_empty(bins.shape)


@lowering("aten::histogram.bins_tensor", meta=_meta_histogram_bins)
def histogram_bins_tensor(x, bins, weight=None, density=False):
    edges = [bins.astype(x.dtype)]
    return _hist_counts(jnp.reshape(x, (-1, 1)), edges, weight, density), bins


def _check_hdd_bins(x, bins):
    if len(bins) != x.shape[-1]:
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")


def _meta_hdd_edges(x, bins, range=None, weight=None, density=False):
    _check_hdd_bins(x, bins)
    return [x.new_empty((n + 1,)) for n in bins]


@lowering("aten::_histogramdd_bin_edges", static=("bins", "range"), meta=_meta_hdd_edges)
def histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return tuple(_hist_edges(jnp.reshape(x, (-1, x.shape[-1])), tuple(bins), range))


def _meta_hdd_cts(x, bins, range=None, weight=None, density=False):
    _check_hdd_bins(x, bins)
    return x.new_empty(tuple(bins))


@lowering("aten::_histogramdd_from_bin_cts", static=("bins", "range"), meta=_meta_hdd_cts)
def histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    x2 = jnp.reshape(x, (-1, x.shape[-1]))
    return _hist_counts(x2, _hist_edges(x2, tuple(bins), range), weight, density)


def _meta_hdd_tensors(x, bins, weight=None, density=False):
    _check_hdd_bins(x, bins)
    return x.new_empty(tuple(b.shape[0] - 1 for b in bins))


@lowering("aten::_histogramdd_from_bin_tensors", meta=_meta_hdd_tensors)
def histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    x2 = jnp.reshape(x, (-1, x.shape[-1]))
    return _hist_counts(x2, [b.astype(x.dtype) for b in bins], weight, density)
