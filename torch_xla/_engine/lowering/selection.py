"""Sorting and selection (sort, topk, kthvalue, median, mode...) and segment_reduce."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
from jax import lax

from .table import lowering
from .reductions import _as_vec, _axis, _is_float, _out


# ---- sorting and selection ---------------------------------------------------------------------------

def _sort_key(x):
    """A key whose lax.sort order is PyTorch's: every NaN is the largest value (and NaNs
    are equal), -0.0 equals 0.0; bools sort as 0/1."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    if _is_float(x):
        z = jnp.zeros((), x.dtype)
        x = jnp.where(x == 0, z, x)
        return jnp.where(jnp.isnan(x), jnp.full((), jnp.nan, x.dtype), x)
    return x


def _sort(x, axis, descending):
    """A stable sort along axis: (values, int64 indices). Descending keeps equal elements
    in their original order too."""
    n = x.shape[axis]
    key = _sort_key(x)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    if not descending:
        _, vals, inds = lax.sort((key, x, idx), dimension=axis, is_stable=True, num_keys=1)
        return vals, inds
    # Descending: sort the reversed sequence ascending (stable), then reverse the result;
    # ties come out in increasing original index.
    rk = lax.rev(key, (axis,))
    rx = lax.rev(x, (axis,))
    _, vals, inds = lax.sort((rk, rx, idx), dimension=axis, is_stable=True, num_keys=1)
    vals = lax.rev(vals, (axis,))
    inds = (n - 1) - lax.rev(inds, (axis,))
    return vals, inds


@lowering("aten::sort")
def sort(x, dim=-1, descending=False):
    v = _as_vec(x)
    vals, inds = _sort(v, _axis(dim, v.ndim), descending)
    return _out(vals, 0), _out(inds, 1)


@lowering("aten::sort.stable")
def sort_stable(x, stable=None, dim=-1, descending=False):
    return sort(x, dim, descending)


@lowering("aten::topk")
def topk(x, k, dim=-1, largest=True, sorted=True):
    v = _as_vec(x)
    axis = _axis(dim, v.ndim)
    vals, inds = _sort(v, axis, largest)
    return (_out(lax.slice_in_dim(vals, 0, k, axis=axis), 0),
            _out(lax.slice_in_dim(inds, 0, k, axis=axis), 1))


@lowering("aten::kthvalue")
def kthvalue(x, k, dim=-1, keepdim=False):
    v = _as_vec(x)
    axis = _axis(dim, v.ndim)
    vals, inds = _sort(v, axis, False)
    return (_out(lax.index_in_dim(vals, k - 1, axis, keepdims=False), 0),
            _out(lax.index_in_dim(inds, k - 1, axis, keepdims=False), 1))


def _median(v, axis, ignore_nan):
    """Lower median along axis with its index. torch.median returns the first NaN of a
    slice holding one; nanmedian takes the median of the non-NaN values."""
    n = v.shape[axis]
    vals, inds = _sort(v, axis, False)
    if _is_float(v):
        nnan = jnp.sum(jnp.isnan(v), axis=axis, keepdims=True)
        if ignore_nan:
            pos = jnp.maximum((n - nnan - 1) // 2, 0)
        else:
            pos = jnp.where(nnan > 0, n - nnan, (n - 1) // 2)
        pos = pos.astype(jnp.int64)
        return (jnp.squeeze(jnp.take_along_axis(vals, pos, axis), axis),
                jnp.squeeze(jnp.take_along_axis(inds, pos, axis), axis))
    k = (n - 1) // 2
    return lax.index_in_dim(vals, k, axis, keepdims=False), lax.index_in_dim(inds, k, axis, keepdims=False)


@lowering("aten::median")
def median(x):
    return _out(_median(jnp.reshape(x, (-1,)), 0, False)[0])


@lowering("aten::nanmedian")
def nanmedian(x):
    return _out(_median(jnp.reshape(x, (-1,)), 0, True)[0])


@lowering("aten::median.dim")
def median_dim(x, dim, keepdim=False):
    v = _as_vec(x)
    vals, inds = _median(v, _axis(dim, v.ndim), False)
    return _out(vals, 0), _out(inds, 1)


@lowering("aten::nanmedian.dim")
def nanmedian_dim(x, dim, keepdim=False):
    v = _as_vec(x)
    vals, inds = _median(v, _axis(dim, v.ndim), True)
    return _out(vals, 0), _out(inds, 1)


@lowering("aten::mode")
def mode(x, dim=-1, keepdim=False):
    """The most frequent value of each slice (the smallest among equally frequent ones)
    and the index of its last occurrence (the CPU kernel's index among equal elements
    depends on its unstable sort; it agrees with this for short slices)."""
    v = _as_vec(x)
    axis = _axis(dim, v.ndim)
    v = jnp.moveaxis(v, axis, -1)
    last = v.ndim - 1
    vals, inds = _sort(v, last, False)
    # Runs of equal values in the sorted slice: count[j] = j - start of j's run + 1. The
    # first position reaching the largest count ends the run of the smallest most
    # frequent value, and (the sort being stable) holds its last original index.
    key = _sort_key(vals)
    new_run = jnp.concatenate([jnp.ones(key.shape[:-1] + (1,), bool), key[..., 1:] != key[..., :-1]], axis=-1)
    iota = lax.broadcasted_iota(jnp.int64, key.shape, last)
    start = lax.cummax(jnp.where(new_run, iota, 0), axis=last)
    count = iota - start + 1
    pos = jnp.argmax(count, axis=-1)[..., None]
    val = jnp.take_along_axis(vals, pos, axis=-1)[..., 0]
    ind = jnp.take_along_axis(inds, pos, axis=-1)[..., 0]
    return _out(val, 0), _out(ind, 1)


# ---- segment_reduce ------------------------------------------------------------------------------

def _segments(data, lengths, offsets, axis):
    """Per element along `axis`: its segment id (S = no segment), the segment count S and
    the segment lengths. lengths/offsets carry data's leading dims (before axis)."""
    axis = axis % data.ndim
    if offsets is None:
        lengths = lengths.astype(jnp.int64)
        zero = jnp.zeros(lengths.shape[:-1] + (1,), jnp.int64)
        offsets = jnp.concatenate([zero, jnp.cumsum(lengths, axis=-1)], axis=-1)
    offsets = offsets.astype(jnp.int64)
    lens = offsets[..., 1:] - offsets[..., :-1]
    s = lens.shape[-1]
    n = data.shape[axis]
    j = jnp.arange(n, dtype=jnp.int64)
    ids = jnp.sum(offsets[..., 1:, None] <= j, axis=-2)  # (..., N)
    ids = jnp.where(j >= offsets[..., :1], ids, s)
    return ids, s, lens


def _seg_flat(data, ids, s, axis):
    """data as (B*N, R) rows and their global segment rows in a (B*(S+1), R) table."""
    axis = axis % data.ndim
    lead = data.shape[:axis]
    b = int(np.prod(lead)) if lead else 1
    n = data.shape[axis]
    r = int(np.prod(data.shape[axis + 1:])) if data.ndim > axis + 1 else 1
    rows = jnp.reshape(data, (b * n, r))
    gid = jnp.broadcast_to(ids, lead + (n,)).reshape(b, n) + (jnp.arange(b, dtype=jnp.int64) * (s + 1))[:, None]
    return rows, gid.reshape(-1), b, r


def _seg_unflat(table, b, s, data_shape, axis):
    axis = axis % len(data_shape)
    t = jnp.reshape(table, (b, s + 1, -1))[:, :s]
    return jnp.reshape(t, data_shape[:axis] + (s,) + data_shape[axis + 1:])


def _seg_init(reduce, dt, initial):
    if initial is not None:
        return jnp.asarray(initial).astype(dt)
    return {"max": jnp.asarray(-jnp.inf, dt), "min": jnp.asarray(jnp.inf, dt),
            "prod": jnp.ones((), dt)}.get(reduce, jnp.zeros((), dt))


@lowering("aten::segment_reduce")
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """The CPU kernel: each segment starts from `initial` (or the reduction's identity);
    mean divides by the segment length, an empty mean segment is `initial` or NaN."""
    dt = data.dtype
    ids, s, lens = _segments(data, lengths, offsets, axis)
    rows, gid, b, r = _seg_flat(data, ids, s, axis)
    init = _seg_init(reduce, dt, initial)
    table = jnp.full((b * (s + 1), r), init, dt).at[gid]
    if reduce in ("sum", "mean"):
        table = table.add(rows)
    elif reduce == "prod":
        table = table.multiply(rows)
    elif reduce == "max":
        table = table.max(rows)
    elif reduce == "min":
        table = table.min(rows)
    else:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    out = _seg_unflat(table, b, s, data.shape, axis)
    if reduce == "mean":
        ax = axis % data.ndim
        ln = jnp.reshape(lens, lens.shape + (1,) * (data.ndim - ax - 1)).astype(dt)
        empty = ln == 0
        out = jnp.where(empty, jnp.full((), jnp.nan, dt) if initial is None else out,
                        out / jnp.where(empty, jnp.ones((), dt), ln))
    return out


@lowering("aten::_segment_reduce_backward")
def segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    dt = data.dtype
    ax = axis % data.ndim
    ids, s, lens = _segments(data, lengths, offsets, ax)
    # Per element: the gradient / output / length of its segment (zero outside any segment).
    pad = [(0, 0)] * data.ndim
    pad[ax] = (0, 1)
    idx = jnp.reshape(ids, ids.shape + (1,) * (data.ndim - ax - 1))
    idx = jnp.broadcast_to(idx, data.shape)

    def per_elem(t):
        t = jnp.pad(t.astype(dt), pad)
        return jnp.take_along_axis(t, idx, axis=ax)

    inside = idx < s
    g = jnp.where(inside, per_elem(grad), jnp.zeros((), dt))
    if reduce == "sum":
        return g
    ln = jnp.reshape(lens, lens.shape + (1,) * (data.ndim - ax - 1))
    if reduce == "mean":
        return g / jnp.maximum(per_elem(jnp.broadcast_to(ln, output.shape)), 1)
    o = per_elem(output)
    if reduce in ("max", "min"):
        eq = inside & (data == o)
        rows, gid, b, r = _seg_flat(eq.astype(dt), ids, s, ax)
        cnt = _seg_unflat(jnp.zeros((b * (s + 1), r), dt).at[gid].add(rows), b, s, data.shape, ax)
        return jnp.where(eq, g / jnp.maximum(per_elem(cnt), 1), jnp.zeros((), dt))
    if reduce == "prod":
        # d/dx_i = initial * prod of the other elements: output / x_i without zeros; with
        # zeros, only a lone zero gets a gradient (the product of the nonzero elements).
        zero = data == 0
        rows, gid, b, r = _seg_flat(zero.astype(jnp.int64), ids, s, ax)
        nz = per_elem(_seg_unflat(jnp.zeros((b * (s + 1), r), jnp.int64).at[gid].add(rows), b, s, data.shape, ax))
        nonzero = jnp.where(zero, jnp.ones((), dt), data)
        rows, gid, b, r = _seg_flat(nonzero, ids, s, ax)
        init = _seg_init("prod", dt, initial)
        pnz = per_elem(_seg_unflat(jnp.full((b * (s + 1), r), init, dt).at[gid].multiply(rows), b, s, data.shape, ax))
        d = jnp.where(nz == 0, o / nonzero, jnp.where(zero & (nz == 1), pnz, jnp.zeros((), dt)))
        return jnp.where(inside, g * d, jnp.zeros((), dt))
    raise RuntimeError(f"unsupported reduction {reduce}")
