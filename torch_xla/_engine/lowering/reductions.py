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

from ..platform.base import ALL_PRODUCTS
from .table import ctx, lowering, out_dtype, out_shape

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
    # math.prod, not numpy: a size may be a symbolic dimension (StableHLO export with Dims)
    return math.prod(shape[a] for a in axes)


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

def _meta_nonempty(name: str, overload: str = "default"):
    """PyTorch's meta kernel after the CPU's checks: max / min / amax / amin of no elements
    have no value (the meta kernels let them through)."""
    def meta(x, dim=None, *rest):
        dims = [dim] if isinstance(dim, int) else list(dim or ())
        if not dims:
            if x.numel() == 0:
                raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                                   "Specify the reduction dim with the 'dim' argument.")
        elif x.dim() > 0:
            for d in dims:
                w = d % x.dim() if -x.dim() <= d < x.dim() else d
                if 0 <= w < x.dim() and x.shape[w] == 0:
                    # max.dim / min.dim name the wrapped dim, amax / amin the one given
                    shown = w if overload == "dim" else d
                    raise IndexError(f"{name}(): Expected reduction dim {shown} to have non-zero size.")
        op = getattr(getattr(torch.ops.aten, name), overload)
        return op(x) if dim is None else op(x, dim, *rest)
    return meta


@lowering("aten::amax", meta=_meta_nonempty("amax"))
def amax(x, dim=(), keepdim=False):
    return _out(_reduce(_nan_max, x, dim))


@lowering("aten::amin", meta=_meta_nonempty("amin"))
def amin(x, dim=(), keepdim=False):
    return _out(_reduce(_nan_min, x, dim))


@lowering("aten::max", meta=_meta_nonempty("max"))
def max_(x):
    return _out(_reduce(_nan_max, x, None))


@lowering("aten::min", meta=_meta_nonempty("min"))
def min_(x):
    return _out(_reduce(_nan_min, x, None))


def _argext(x, axis, is_max):
    """Index of the first maximum (minimum) along axis; a NaN counts as the extreme."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return (jnp.argmax if is_max else jnp.argmin)(x, axis=axis)


@lowering("aten::max.dim", meta=_meta_nonempty("max", "dim"))
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    a = _axis(dim, x.ndim)
    return _out(_nan_max(x, a), 0), _out(_argext(x, a, True), 1)


@lowering("aten::min.dim", meta=_meta_nonempty("min", "dim"))
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


def scaled_softmax_of(z, axis):
    """softmax of `z` along `axis` (z already shifted by its maximum) as exp(z) * (1 / sum):
    one exp per element (see `softmax` for where it is used)."""
    e = jnp.exp(z)
    return e * (1 / jnp.sum(e, axis=axis, keepdims=True))


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
    # exp(z) / sum is cheaper (one exp per element, not two), but XLA fuses that cheap
    # scaling into every consumer of the probabilities, the backward included, so exp(z)
    # stays alive beside them from forward to backward; an exp as the last op is not
    # duplicated, so only the probabilities are kept (bench_patches.py --compare softmax:
    # 256 MiB less per decoder step, same time). Where the products are the BLAS handler's
    # calls, which read materialized operands, the probabilities are kept either way and
    # the scaled form is faster (the decoder's step 3.5% at batch 16 x 512; BENCHMARKS.md,
    # issue 35, eighth session); it is also PyTorch's CPU kernel's form.
    z, axis = _softmax_parts(x, dim)
    if ctx.library_products == ALL_PRODUCTS:
        return _out(scaled_softmax_of(z, axis))
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


@lowering("aten::hash_tensor")
def hash_tensor(x, dim=(), keepdim=False, mode=0):
    """The xor of the elements' bits as uint64, each upcast to float64 or int64 first."""
    wide = x.astype(jnp.float64 if _is_float(x) else jnp.int64)
    bits = lax.bitcast_convert_type(wide, jnp.uint64)
    axes = _axes(dim, x.ndim)
    return _out(lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes))
