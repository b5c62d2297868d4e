"""Reductions, scans, softmax and sorting (forward and the backward ops autograd uses).

Conventions shared by the lowerings below:
- the executor casts each result to the dtype PyTorch's meta kernel predicted, and
  `out_shape(i)` gives the predicted shape, so reductions always reduce without
  keepdim and reshape to the predicted shape at the end (keepdim only inserts ones);
- values are computed in the dtype that gives PyTorch's numbers: integer/bool sums in
  the (int64) result dtype, bf16/f16 in float32 with one rounding at the end (as the
  CPU kernels accumulate in float);
- a 0-d tensor accepts dim 0/-1 and reduces over nothing.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .table import lowering, out_dtype, out_shape

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# ---- helpers ------------------------------------------------------------------------------

def _calc(dt):
    """The dtype a result of dtype `dt` is computed in."""
    dt = np.dtype(dt)
    return np.dtype(np.float32) if dt in _HALF else dt


def _is_float(x):
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _axes(dim, ndim, empty_is_all=True):
    """Normalized reduction axes. `dim` is None, an int or a sequence of ints."""
    if ndim == 0:
        return ()
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if len(dim) == 0:
        return tuple(range(ndim)) if empty_is_all else ()
    return tuple(sorted({d % ndim for d in dim}))


def _axis(dim, ndim):
    return 0 if ndim == 0 else dim % ndim


def _out(y, i=0):
    return jnp.reshape(y, out_shape(i))


def _as_vec(x):
    """0-d tensors take part in dim-wise ops as one-element vectors."""
    return jnp.reshape(x, (1,)) if x.ndim == 0 else x


def _to_out_calc(x, i=0):
    """x cast to the computing dtype of output i."""
    return x.astype(_calc(out_dtype(i)))


def _reduce(fn, x, dim, empty_is_all=True):
    axes = _axes(dim, x.ndim, empty_is_all)
    if not axes:
        return x
    return fn(x, axis=axes)


def _nan_max(x, axis):
    """max that propagates NaN (jnp.max/min already do; kept explicit for bool)."""
    if x.dtype == jnp.bool_:
        return jnp.any(x, axis=axis)
    return jnp.max(x, axis=axis)


def _nan_min(x, axis):
    if x.dtype == jnp.bool_:
        return jnp.all(x, axis=axis)
    return jnp.min(x, axis=axis)


# ---- sum / mean / prod -----------------------------------------------------------------------

@lowering("aten::sum")
def sum_(x, dtype=None):
    return _out(_reduce(jnp.sum, _to_out_calc(x), None))


@lowering("aten::sum.dim_IntList")
def sum_dim(x, dim=None, keepdim=False, dtype=None):
    return _out(_reduce(jnp.sum, _to_out_calc(x), dim))


@lowering("aten::nansum")
def nansum(x, dim=None, keepdim=False, dtype=None):
    x = _to_out_calc(x)
    if _is_float(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return _out(_reduce(jnp.sum, x, dim))


def _count(shape, axes):
    return int(np.prod([shape[a] for a in axes])) if axes else 1


def _mean(x, dim):
    x = _to_out_calc(x)
    axes = _axes(dim, x.ndim)
    if not axes:
        return x
    return jnp.sum(x, axis=axes) / _count(x.shape, axes)


@lowering("aten::mean")
def mean(x, dtype=None):
    return _out(_mean(x, None))


@lowering("aten::mean.dim")
def mean_dim(x, dim=None, keepdim=False, dtype=None):
    return _out(_mean(x, dim))


@lowering("aten::prod")
def prod(x, dtype=None):
    return _out(_reduce(jnp.prod, _to_out_calc(x), None))


@lowering("aten::prod.dim_int")
def prod_dim(x, dim, keepdim=False, dtype=None):
    return _out(_reduce(jnp.prod, _to_out_calc(x), dim))


# ---- max / min ---------------------------------------------------------------------------------

@lowering("aten::amax")
def amax(x, dim=(), keepdim=False):
    return _out(_reduce(_nan_max, x, dim))


@lowering("aten::amin")
def amin(x, dim=(), keepdim=False):
    return _out(_reduce(_nan_min, x, dim))


@lowering("aten::max")
def max_(x):
    return _out(_reduce(_nan_max, x, None))


@lowering("aten::min")
def min_(x):
    return _out(_reduce(_nan_min, x, None))


def _argext(x, axis, is_max):
    """Index of the first maximum (minimum) along axis; a NaN counts as the extreme."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return (jnp.argmax if is_max else jnp.argmin)(x, axis=axis)


@lowering("aten::max.dim")
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    a = _axis(dim, x.ndim)
    return _out(_nan_max(x, a), 0), _out(_argext(x, a, True), 1)


@lowering("aten::min.dim")
def min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    a = _axis(dim, x.ndim)
    return _out(_nan_min(x, a), 0), _out(_argext(x, a, False), 1)


def _arg(x, dim, is_max):
    if dim is None:
        return _out(_argext(jnp.reshape(x, (-1,)), 0, is_max))
    if x.ndim == 0:
        return jnp.zeros(out_shape(), jnp.int64)
    return _out(_argext(x, _axis(dim, x.ndim), is_max))


@lowering("aten::argmax")
def argmax(x, dim=None, keepdim=False):
    return _arg(x, dim, True)


@lowering("aten::argmin")
def argmin(x, dim=None, keepdim=False):
    return _arg(x, dim, False)


@lowering("aten::aminmax")
def aminmax(x, dim=None, keepdim=False):
    axes = _axes(dim, x.ndim)
    if not axes:
        return _out(x, 0), _out(x, 1)
    return _out(_nan_min(x, axes), 0), _out(_nan_max(x, axes), 1)


# ---- variance ----------------------------------------------------------------------------------

def _var(x, dim, correction):
    x = _to_out_calc(x)
    axes = _axes(dim, x.ndim)
    n = _count(x.shape, axes)
    c = 1 if correction is None else correction
    if not axes:
        m = x
        ss = jnp.zeros_like(x)
    else:
        m = jnp.mean(x, axis=axes, keepdims=True)
        d = x - m
        if jnp.issubdtype(d.dtype, jnp.complexfloating):
            ss = jnp.sum(jnp.real(d * jnp.conj(d)), axis=axes)
        else:
            ss = jnp.sum(d * d, axis=axes)
        m = jnp.squeeze(m, axes)
    return ss / max(n - c, 0), m


@lowering("aten::var.correction", static=("correction",))
def var(x, dim=None, correction=None, keepdim=False):
    return _out(_var(x, dim, correction)[0])


@lowering("aten::std.correction", static=("correction",))
def std(x, dim=None, correction=None, keepdim=False):
    return _out(jnp.sqrt(_var(x, dim, correction)[0]))


@lowering("aten::var_mean.correction", static=("correction",))
def var_mean(x, dim=None, correction=None, keepdim=False):
    v, m = _var(x, dim, correction)
    return _out(v, 0), _out(m, 1)


@lowering("aten::std_mean.correction", static=("correction",))
def std_mean(x, dim=None, correction=None, keepdim=False):
    v, m = _var(x, dim, correction)
    return _out(jnp.sqrt(v), 0), _out(m, 1)


# ---- logsumexp, logical, counting ------------------------------------------------------------------

@lowering("aten::logsumexp")
def logsumexp(x, dim, keepdim=False):
    x = _to_out_calc(x)
    axes = _axes(dim, x.ndim)
    if not axes:
        return _out(x)
    m = jnp.max(x, axis=axes, keepdims=True)
    m = jnp.where(jnp.isinf(m), jnp.zeros((), m.dtype), m)
    r = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return _out(r)


def _truth(x):
    return x if x.dtype == jnp.bool_ else x != 0


@lowering("aten::all")
def all_(x):
    return _out(jnp.all(_truth(x)))


@lowering("aten::any")
def any_(x):
    return _out(jnp.any(_truth(x)))


@lowering("aten::all.dim")
def all_dim(x, dim, keepdim=False):
    return _out(_reduce(jnp.all, _truth(x), dim))


@lowering("aten::any.dim")
def any_dim(x, dim, keepdim=False):
    return _out(_reduce(jnp.any, _truth(x), dim))


@lowering("aten::all.dims")
def all_dims(x, dim=None, keepdim=False):
    return _out(_reduce(jnp.all, _truth(x), dim, empty_is_all=False))


@lowering("aten::any.dims")
def any_dims(x, dim=None, keepdim=False):
    return _out(_reduce(jnp.any, _truth(x), dim, empty_is_all=False))


@lowering("aten::count_nonzero.dim_IntList")
def count_nonzero_dims(x, dim):
    return _out(_reduce(jnp.sum, _truth(x).astype(jnp.int64), dim))


@lowering("aten::count_nonzero")
def count_nonzero(x, dim=None):
    return _out(_reduce(jnp.sum, _truth(x).astype(jnp.int64), dim))


# ---- norms ---------------------------------------------------------------------------------------

def _vector_norm(x, ord, dim):
    x = _to_out_calc(x) if not jnp.issubdtype(x.dtype, jnp.complexfloating) else x
    a = jnp.abs(x).astype(_calc(out_dtype()))
    axes = _axes(dim, x.ndim)
    ord = 2.0 if ord is None else float(ord)

    def red(fn, v):
        return fn(v, axis=axes) if axes else v

    if ord == math.inf:
        return red(jnp.max, a)
    if ord == -math.inf:
        return red(jnp.min, a)
    if ord == 0:
        return red(jnp.sum, (a != 0).astype(a.dtype))
    if ord == 1:
        return red(jnp.sum, a)
    if ord == 2:
        return jnp.sqrt(red(jnp.sum, a * a))
    return red(jnp.sum, a ** ord) ** (1.0 / ord)


@lowering("aten::linalg_vector_norm", static=("ord",))
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    return _out(_vector_norm(x, ord, dim))


@lowering("aten::norm.Scalar", static=("p",))
def norm_scalar(x, p=2):
    return _out(_vector_norm(x, p, None))


@lowering("aten::norm.ScalarOpt_dim", "aten::norm.ScalarOpt_dim_dtype", static=("p",))
def norm_dim(x, p, dim, keepdim=False, dtype=None):
    return _out(_vector_norm(x, p, dim))


@lowering("aten::norm.ScalarOpt_dtype", static=("p",))
def norm_dtype(x, p, dtype=None):
    return _out(_vector_norm(x, p, None))


@lowering("aten::renorm", static=("p", "maxnorm"))
def renorm(x, p, dim, maxnorm):
    """Each slice along `dim` whose p-norm exceeds maxnorm is scaled to norm maxnorm."""
    dt = _calc(x.dtype)
    xc = x.astype(dt)
    d = _axis(dim, x.ndim)
    axes = tuple(i for i in range(x.ndim) if i != d)
    a = jnp.abs(xc)
    p = float(p)
    if p == math.inf:
        n = jnp.max(a, axis=axes, keepdims=True) if axes else a
    elif p == 0:
        n = jnp.sum((a != 0).astype(dt), axis=axes, keepdims=True) if axes else (a != 0).astype(dt)
    else:
        n = (jnp.sum(a ** p, axis=axes, keepdims=True) if axes else a ** p) ** (1.0 / p)
    scale = jnp.where(n > maxnorm, maxnorm / (n + 1e-7), jnp.ones((), dt))
    return xc * scale


# ---- scans ---------------------------------------------------------------------------------------

@lowering("aten::cumsum")
def cumsum(x, dim, dtype=None):
    x = _as_vec(_to_out_calc(x))
    return _out(jnp.cumsum(x, axis=_axis(dim, x.ndim)))


@lowering("aten::cumprod")
def cumprod(x, dim, dtype=None):
    x = _as_vec(_to_out_calc(x))
    return _out(jnp.cumprod(x, axis=_axis(dim, x.ndim)))


def _logcumsumexp_meta(x, dim):
    import torch
    return torch.empty_like(x)


@lowering("aten::_logcumsumexp", "aten::logcumsumexp", meta=_logcumsumexp_meta)
def logcumsumexp(x, dim):
    x = _as_vec(_to_out_calc(x))
    return _out(lax.cumlogsumexp(x, axis=_axis(dim, x.ndim)))


def _cum_ext(x, dim, is_max):
    """cummax/cummin: the running extreme and the index of the latest element equal to it
    (a NaN is the extreme; the latest NaN wins), as the CPU kernel does."""
    x = _as_vec(x)
    axis = _axis(dim, x.ndim)
    v = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    idx = lax.broadcasted_iota(jnp.int64, v.shape, axis)
    fl = _is_float(v)

    def comb(a, b):
        av, ai = a
        bv, bi = b
        better = (bv >= av) if is_max else (bv <= av)
        if fl:
            better = jnp.isnan(bv) | (~jnp.isnan(av) & better)
        return jnp.where(better, bv, av), jnp.where(better, bi, ai)

    vals, inds = lax.associative_scan(comb, (v, idx), axis=axis)
    return _out(vals, 0), _out(inds, 1)


@lowering("aten::cummax")
def cummax(x, dim):
    return _cum_ext(x, dim, True)


@lowering("aten::cummin")
def cummin(x, dim):
    return _cum_ext(x, dim, False)


# ---- softmax -------------------------------------------------------------------------------------

def _softmax_parts(x, dim):
    x = _as_vec(_to_out_calc(x))
    axis = _axis(dim, x.ndim)
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    z = x - m
    return z, axis


def log_softmax_of(z, axis):
    """log_softmax of `z` along `axis` (z already shifted by its maximum); softmax is its
    exp (see `softmax`)."""
    return z - jnp.log(jnp.sum(jnp.exp(z), axis=axis, keepdims=True))


def _softmax_meta(op_name):
    """PyTorch's meta kernel for (log_)softmax does not check `dim`; the CPU does."""
    def meta(x, dim, half_to_float):
        n = max(x.dim(), 1)
        if not -n <= dim < n:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
        return getattr(torch.ops.aten, op_name)(x, dim, half_to_float)
    return meta


@lowering("aten::_softmax", meta=_softmax_meta("_softmax"))
def softmax(x, dim, half_to_float=False):
    # exp(z) / sum would be cheaper, but XLA fuses that cheap scaling into every consumer
    # of the probabilities, the backward included, so exp(z) stays alive beside them from
    # forward to backward; an exp as the last op is not duplicated, so only the
    # probabilities are kept (bench_patches.py --compare softmax: 256 MiB less per decoder
    # step, same time).
    z, axis = _softmax_parts(x, dim)
    return _out(jnp.exp(log_softmax_of(z, axis)))


@lowering("aten::_log_softmax", meta=_softmax_meta("_log_softmax"))
def log_softmax(x, dim, half_to_float=False):
    z, axis = _softmax_parts(x, dim)
    return _out(log_softmax_of(z, axis))


@lowering("aten::_softmax_backward_data")
def softmax_backward_data(grad, output, dim, input_dtype):
    dt = _calc(out_dtype())
    g = _as_vec(grad.astype(dt))
    y = _as_vec(output.astype(dt))
    axis = _axis(dim, g.ndim)
    return _out(y * (g - jnp.sum(g * y, axis=axis, keepdims=True)))


@lowering("aten::_log_softmax_backward_data")
def log_softmax_backward_data(grad, output, dim, input_dtype):
    dt = _calc(out_dtype())
    g = _as_vec(grad.astype(dt))
    y = _as_vec(output.astype(dt))
    axis = _axis(dim, g.ndim)
    return _out(g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True))


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


# ---- CTC loss ------------------------------------------------------------------------------------

def _logaddexp(a, b):
    """log(exp(a) + exp(b)) whose gradient is 0, not NaN, where both are -inf."""
    m = lax.stop_gradient(jnp.maximum(a, b))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    s = jnp.exp(a - m) + jnp.exp(b - m)
    pos = s > 0
    return jnp.where(pos, m + jnp.log(jnp.where(pos, s, jnp.ones((), s.dtype))), jnp.asarray(-jnp.inf, s.dtype))


def _ctc_nll(log_probs, targets, input_lengths, target_lengths, blank, s_max):
    """(nll (N,), log_alpha (N, T, 2*s_max+1)) by the forward recursion over time in log
    space; alpha stops changing after a sample's input length."""
    lp = log_probs if log_probs.ndim == 3 else log_probs[:, None, :]
    t_len, n, _ = lp.shape
    il = jnp.reshape(jnp.asarray(input_lengths), (-1,)).astype(jnp.int64)
    tl = jnp.reshape(jnp.asarray(target_lengths), (-1,)).astype(jnp.int64)
    k = jnp.arange(s_max, dtype=jnp.int64)
    if targets.ndim == 2:
        tg = targets[:, :s_max]
    elif log_probs.ndim == 2:
        tg = targets[None, :s_max]
    else:  # concatenated targets
        off = jnp.cumsum(tl) - tl
        tg = jnp.take(targets, jnp.clip(off[:, None] + k, 0, max(targets.shape[0] - 1, 0)), mode="clip")
    tg = jnp.reshape(tg, (n, s_max)).astype(jnp.int64)
    big_l = 2 * s_max + 1
    ext = jnp.full((n, big_l), blank, jnp.int64)
    if s_max:
        ext = ext.at[:, 1::2].set(tg)
    lpe = jnp.take_along_axis(lp, jnp.broadcast_to(ext[None], (t_len, n, big_l)), axis=2)  # (T, N, L)
    s = jnp.arange(big_l)
    prev2 = jnp.concatenate([jnp.full((n, 2), -1, jnp.int64), ext[:, :-2]], axis=1)
    skip = (s >= 2) & (ext != blank) & (ext != prev2)
    valid = s[None, :] < (2 * tl + 1)[:, None]
    ninf = jnp.asarray(-jnp.inf, lp.dtype)
    a0 = jnp.where((s[None, :] == 0) | ((s[None, :] == 1) & (tl[:, None] > 0)), lpe[0], ninf)
    a0 = jnp.where(valid, a0, ninf)

    def shift(a, m):
        return jnp.concatenate([jnp.full((n, m), ninf, a.dtype), a[:, :-m]], axis=1)

    def step(a, xs):
        t, row = xs
        new = _logaddexp(_logaddexp(a, shift(a, 1)), jnp.where(skip, shift(a, 2), ninf)) + row
        new = jnp.where(valid, new, ninf)
        new = jnp.where((t < il)[:, None], new, a)
        return new, new

    last, rest = lax.scan(step, a0, (jnp.arange(1, t_len, dtype=jnp.int64), lpe[1:]))
    log_alpha = jnp.concatenate([a0[None], rest], axis=0)  # (T, N, L)
    end = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    end1 = jnp.where(tl > 0, jnp.take_along_axis(last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0], ninf)
    nll = -_logaddexp(end, end1)
    return nll, jnp.swapaxes(log_alpha, 0, 1)


def _ctc_meta(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """(nll (N,), log_alpha (N, T, 2 * max(target_lengths) + 1)); the width needs the
    lengths' values, so tensor lengths take the CPU."""
    if isinstance(target_lengths, torch.Tensor):
        raise NotImplementedError("ctc_loss with tensor lengths: the output width depends on their values")
    if log_probs.dim() != 3:
        raise RuntimeError(f"Expected 3-dimensional tensor, but got {log_probs.dim()}-dimensional tensor "
                           f"for argument #1 'log_probs' (while checking arguments for ctc_loss_allocate_outputs)")
    t, n = log_probs.shape[0], log_probs.shape[1]
    if len(input_lengths) != n or len(target_lengths) != n:
        raise RuntimeError("input_lengths and target_lengths must have size batch_size")
    s = max(target_lengths) if len(target_lengths) else 0
    e = lambda *sh: torch.empty(sh, dtype=log_probs.dtype, device="meta")  # noqa: E731
    return e(n), e(n, t, 2 * s + 1)


@lowering("aten::_ctc_loss", meta=_ctc_meta)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    s_max = (out_shape(1)[-1] - 1) // 2
    dt = _calc(log_probs.dtype)
    nll, la = _ctc_nll(log_probs.astype(dt), targets, input_lengths, target_lengths, blank, s_max)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), jnp.zeros((), dt), nll)
    return _out(nll, 0), _out(la, 1)


@lowering("aten::_ctc_loss_backward", meta=lambda grad, log_probs, *a, **k: torch.empty_like(log_probs))
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                      zero_infinity=False):
    """PyTorch's gradient: exp(log_probs) - (posterior of each class at t), times the
    incoming gradient, zero past a sample's input length (the exp term assumes log_probs
    come from a log_softmax, whose backward then cancels it)."""
    import jax
    dt = _calc(log_probs.dtype)
    lp = log_probs.astype(dt)
    s_max = (log_alpha.shape[-1] - 1) // 2
    nll_of = lambda x: _ctc_nll(x, targets, input_lengths, target_lengths, blank, s_max)[0]  # noqa: E731
    val, vjp = jax.vjp(nll_of, lp)
    g = jnp.reshape(grad.astype(dt), (-1,))
    g = jnp.broadcast_to(g, val.shape)
    (dlp,) = vjp(jnp.ones_like(val))  # -posterior (per sample)
    batched = lp.ndim == 3
    gb = g[None, :, None] if batched else g[:, None]
    out = (jnp.exp(lp) + dlp) * gb
    il = jnp.reshape(jnp.asarray(input_lengths), (-1,)).astype(jnp.int64)
    t = jnp.arange(lp.shape[0])
    inside = (t[:, None] < il[None, :])[..., None] if batched else (t < il[0])[:, None]
    bad = jnp.isinf(val)[None, :, None] if batched else jnp.isinf(val)[:, None]
    out = jnp.where(inside, out, jnp.zeros((), dt))
    if zero_infinity:
        out = jnp.where(bad, jnp.zeros((), dt), out)
    return out
