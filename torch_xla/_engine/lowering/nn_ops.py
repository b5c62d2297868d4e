"""Neural-network ops: convolution, pooling, normalization, embedding, losses, dropout,
upsampling, padding, im2col/col2im and attention helpers (forward and backward).

Only ops with their own autograd formula are registered here (never a
CompositeImplicitAutograd op: a backend kernel for one disables its decomposition's autograd).
Backward ops of linear forwards (pooling averages, upsampling, padding, im2col, ...) are
written as `jax.vjp` of the forward lowering, so forward and backward always agree.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from . import conv_cpu
from .table import ctx, lowering, out_dtype, out_shape
from .reductions import log_softmax_of

_HI = lax.Precision.HIGHEST


def _has_out(i):
    """Whether output i is wanted (not None, not the empty placeholder of _meta_fill)."""
    return (ctx.out is not None and i < len(ctx.out) and ctx.out[i] is not None
            and tuple(ctx.out[i][0]) != (0,))


def _fill(outs):
    """Unwanted outputs (None) become zeros of the predicted shape."""
    return tuple(jnp.zeros(ctx.out[i][0], ctx.out[i][1]) if o is None and ctx.out[i] is not None else o
                 for i, o in enumerate(outs))


def _meta_fill(opname):
    """A meta function: PyTorch's meta kernel, with None outputs replaced by empty tensors.

    Works around the executor not accepting None avals (graph_executor.lower_node unpacks
    every aval), which the backward ops with an output_mask produce."""
    def meta(*args, **kwargs):
        packet, _, ov = opname.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), ov or "default")
        out = op(*args, **kwargs)
        ref = next(o for o in out if o is not None)
        return tuple(torch.empty((0,), dtype=ref.dtype, device="meta") if o is None else o for o in out)
    return meta


def _opmath(x):
    """bf16/f16 are computed in f32 (as PyTorch's CPU kernels do)."""
    if x is not None and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def _tup(v, n, default=None):
    """Expands an int or a 1-element list to n entries ([] -> default)."""
    if v is None or (isinstance(v, (tuple, list)) and len(v) == 0):
        v = default
    if isinstance(v, (tuple, list)):
        v = tuple(int(a) for a in v)
        return v * n if len(v) == 1 else v
    return (int(v),) * n


def _reduce(loss, reduction):
    if reduction == 0:
        return loss
    if reduction == 1:
        return jnp.mean(loss)
    return jnp.sum(loss)


def _grad_scale(g, x, reduction):
    """The per-element incoming gradient of a reduced loss."""
    if reduction == 1:
        return g / x.size
    return g


# ---- convolution -----------------------------------------------------------------------

def _cpu_formulation(x, transposed, groups) -> bool:
    """Whether conv_cpu's formulations apply: the platform asks for them (XLA:CPU),
    ungrouped, real floating point."""
    return (ctx.patch_convolutions and not transposed and groups == 1 and 1 <= x.ndim - 2 <= 3
            and jnp.issubdtype(x.dtype, jnp.floating))


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    nsp = x.ndim - 2
    stride, padding, dilation = _tup(stride, nsp), _tup(padding, nsp), _tup(dilation, nsp)
    prec = _HI
    if _cpu_formulation(x, transposed, groups):
        return conv_cpu.conv_forward(x, w, stride, padding, dilation)
    if not transposed:
        return conv_cpu.conv_lax(x, w, stride, padding, dilation, groups)
    output_padding = _tup(output_padding, nsp, (0,))
    cin, coutg = w.shape[0], w.shape[1]
    k = w.shape[2:]
    # (Cin, Cout/g, k) -> (Cout, Cin/g, k), spatially flipped
    wt = w.reshape((groups, cin // groups, coutg) + k)
    wt = jnp.swapaxes(wt, 1, 2).reshape((groups * coutg, cin // groups) + k)
    wt = jnp.flip(wt, axis=tuple(range(2, 2 + nsp)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, d, p, op in zip(k, dilation, padding, output_padding)]
    return lax.conv_general_dilated(x, wt, (1,) * nsp, pads, lhs_dilation=stride, rhs_dilation=dilation,
                                    dimension_numbers=conv_cpu.dimension_numbers(nsp), feature_group_count=groups,
                                    precision=prec)


def _conv_meta(opname):
    """PyTorch's meta kernel plus the argument checks it leaves to the CPU kernel."""
    def meta(x, w, b, stride, padding, dilation, *rest):
        if any(p < 0 for p in padding):
            raise RuntimeError("negative padding is not supported")
        if any(s <= 0 for s in stride):
            raise RuntimeError("non-positive stride is not supported")
        return getattr(torch.ops.aten, opname).default(x, w, b, stride, padding, dilation, *rest)
    return meta


@lowering("aten::convolution", meta=_conv_meta("convolution"))
def convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@lowering("aten::_convolution", meta=_conv_meta("_convolution"))
def convolution_(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@lowering("aten::convolution_overrideable", meta=_conv_meta("convolution_overrideable"))
def convolution_overrideable(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    y = _conv(x, w.astype(x.dtype), stride, padding, dilation, transposed, output_padding, groups)
    if b is not None:
        y = y + b.astype(y.dtype).reshape((1, -1) + (1,) * (y.ndim - 2))
    return y


@lowering("aten::convolution_backward", meta=_meta_fill("convolution_backward"))
def convolution_backward(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask=(True, True, True)):
    # _conv picks the CPU formulation itself: its vjp is that formulation's gradient.
    f = lambda xx, ww: _conv(xx, ww, stride, padding, dilation, transposed, output_padding, groups)
    _, vjp = jax.vjp(f, x, w.astype(x.dtype))
    gx, gw = vjp(g.astype(x.dtype))
    gb = jnp.sum(g, axis=(0,) + tuple(range(2, g.ndim))) if _has_out(2) else None
    return _fill((gx if _has_out(0) else None, gw if _has_out(1) else None, gb))


# ---- window gathering (pooling, im2col) -------------------------------------------------

def _window_index(in_size, out_size, k, s, p, d):
    """Per spatial dim: input index (out, k) of each window element and its validity."""
    o = np.arange(out_size)[:, None]
    j = np.arange(k)[None, :]
    idx = o * s - p + j * d
    valid = (idx >= 0) & (idx < in_size)
    return np.clip(idx, 0, in_size - 1), valid


def _gather_windows(x, idxs):
    """x (..., S1..Sn), idxs [(O_i, K_i)] -> (..., O1..On, K1*..*Kn)."""
    n = len(idxs)
    lead = x.ndim - n
    ix = []
    for i, a in enumerate(idxs):
        shape = [1] * (2 * n)
        shape[2 * i], shape[2 * i + 1] = a.shape
        ix.append(jnp.asarray(a.reshape(shape)))
    y = x[(Ellipsis,) + tuple(ix)]  # (..., O1, K1, O2, K2, ...)
    perm = list(range(lead)) + [lead + 2 * i for i in range(n)] + [lead + 2 * i + 1 for i in range(n)]
    y = jnp.transpose(y, perm)
    oshape = tuple(a.shape[0] for a in idxs)
    return y.reshape(y.shape[:lead] + oshape + (int(np.prod([a.shape[1] for a in idxs])),))


def _combine_valid(valids):
    n = len(valids)
    m = np.ones((), bool)
    for i, v in enumerate(valids):
        shape = [1] * (2 * n)
        shape[2 * i], shape[2 * i + 1] = v.shape
        m = m & v.reshape(shape)
    perm = [2 * i for i in range(n)] + [2 * i + 1 for i in range(n)]
    m = np.transpose(m, perm)
    return m.reshape(tuple(v.shape[0] for v in valids) + (-1,))


def _flat_index(idxs, in_sizes):
    """Flat index into each input plane of each window element: (O1..On, K)."""
    n = len(idxs)
    flat = np.zeros((), np.int64)
    for i, a in enumerate(idxs):
        shape = [1] * (2 * n)
        shape[2 * i], shape[2 * i + 1] = a.shape
        stride = int(np.prod(in_sizes[i + 1:]))
        flat = flat + a.reshape(shape).astype(np.int64) * stride
    perm = [2 * i for i in range(n)] + [2 * i + 1 for i in range(n)]
    flat = np.transpose(flat, perm)
    return flat.reshape(tuple(a.shape[0] for a in idxs) + (-1,))


def _lowest(dt):
    if jnp.issubdtype(dt, jnp.floating):
        return jnp.array(-jnp.inf, dt)
    return jnp.array(jnp.iinfo(dt).min, dt)


def _tiled(k, s, p, d, osz, isz):
    """Windows that tile the input (stride == kernel, no padding or dilation): they can be
    cut out with a reshape instead of a gather, and the backward needs no scatter."""
    return all(s[i] == k[i] and p[i] == 0 and d[i] == 1 and osz[i] * k[i] <= isz[i] for i in range(len(k)))


def _tile_windows(x, k, osz):
    """x (..., S1..Sn) -> (..., O1..On, K1*..*Kn) for tiling windows (the gather's order)."""
    n = len(k)
    lead = x.shape[:-n]
    x = x[(Ellipsis,) + tuple(slice(0, o * kk) for o, kk in zip(osz, k))]
    y = x.reshape(lead + tuple(v for o, kk in zip(osz, k) for v in (o, kk)))
    nl = len(lead)
    perm = list(range(nl)) + [nl + 2 * i for i in range(n)] + [nl + 2 * i + 1 for i in range(n)]
    return jnp.transpose(y, perm).reshape(lead + tuple(osz) + (int(np.prod(k)),))


def _tiled_backward(g, x, indices, k):
    """Max-pool gradient for tiling windows: each input element takes its window's
    gradient where it is the window's recorded argmax (elementwise, no scatter)."""
    n = len(k)
    isz = x.shape[-n:]
    gu, iu = g, indices
    for i in range(n):
        ax = g.ndim - n + i
        gu, iu = jnp.repeat(gu, k[i], ax), jnp.repeat(iu, k[i], ax)
    pad = [(0, 0)] * (g.ndim - n) + [(0, isz[i] - gu.shape[g.ndim - n + i]) for i in range(n)]
    gu, iu = jnp.pad(gu, pad), jnp.pad(iu, pad, constant_values=-1)
    pos = np.zeros((), np.int64)
    for i in range(n):
        shape = [1] * n
        shape[i] = isz[i]
        pos = pos + np.arange(isz[i]).reshape(shape) * int(np.prod(isz[i + 1:]))
    return jnp.where(iu == jnp.asarray(pos), gu, jnp.zeros((), g.dtype))


def _max_windows(x, idxs, valids, tiled=None):
    """Max over windows and the flat input-plane index of the max (as the CPU kernel)."""
    n = len(idxs)
    in_sizes = x.shape[-n:]
    if tiled is not None:
        win = _tile_windows(x, *tiled)
    else:
        win = _gather_windows(x, idxs)
        win = jnp.where(_combine_valid(valids), win, _lowest(x.dtype))
    if jnp.issubdtype(x.dtype, jnp.floating):
        # The CPU kernel takes an element that is greater than the maximum so far or NaN:
        # the first maximum, or the window's last NaN (NaNs ranked by position).
        isn = jnp.isnan(win)
        kd = x.dtype if win.shape[-1] <= 256 else jnp.promote_types(x.dtype, jnp.float32)  # exact ranks
        rank = jnp.where(isn, jnp.arange(1, win.shape[-1] + 1, dtype=kd), jnp.zeros((), kd))
        am = jnp.argmax(jnp.where(jnp.any(isn, -1, keepdims=True), rank, win.astype(kd)), axis=-1)
    else:
        am = jnp.argmax(win, axis=-1)
    val = jnp.take_along_axis(win, am[..., None], axis=-1)[..., 0]
    if tiled is not None:
        # The input position of window offset `am`, by arithmetic instead of a gather.
        k, osz = tiled
        am = am.astype(jnp.int64)
        ind = jnp.zeros((), jnp.int64)
        for i in range(n):
            r = (am // int(np.prod(k[i + 1:]))) % k[i]
            shape = [1] * n
            shape[i] = osz[i]
            pos = jnp.asarray(np.arange(osz[i]).reshape(shape) * k[i]) + r
            ind = ind + pos * int(np.prod(in_sizes[i + 1:]))
        return val, ind
    flat = jnp.asarray(_flat_index(idxs, in_sizes))
    flat_b = jnp.broadcast_to(flat, am.shape + flat.shape[-1:])
    ind = jnp.take_along_axis(flat_b, am[..., None], axis=-1)[..., 0]
    return val, ind.astype(jnp.int64)


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nsp):
    k = _tup(kernel_size, nsp)
    s = _tup(stride, nsp, k)
    p = _tup(padding, nsp)
    d = _tup(dilation, nsp)
    osz = out_shape(0)[-nsp:]
    isz = x.shape[-nsp:]
    idxs, valids = zip(*[_window_index(isz[i], osz[i], k[i], s[i], p[i], d[i]) for i in range(nsp)])
    tiled = (k, osz) if _tiled(k, s, p, d, osz, isz) else None
    return _max_windows(x, list(idxs), list(valids), tiled)


def _index_backward(g, x, indices, nsp):
    """Scatter-adds g into each input plane at the flat indices."""
    lead = x.shape[:-nsp]
    plane = int(np.prod(x.shape[-nsp:]))
    gf = g.reshape((-1, int(np.prod(g.shape[-nsp:])) if g.ndim else 1))
    idx = indices.reshape(gf.shape)
    rows = jnp.arange(gf.shape[0])[:, None]
    out = jnp.zeros((gf.shape[0], plane), g.dtype).at[rows, idx].add(gf)
    return out.reshape(lead + x.shape[-nsp:])


@lowering("aten::max_pool2d_with_indices")
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lowering("aten::max_pool3d_with_indices")
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _max_pool_backward(g, x, kernel_size, stride, padding, dilation, indices, nsp):
    k, p, d = _tup(kernel_size, nsp), _tup(padding, nsp), _tup(dilation, nsp)
    s = _tup(stride, nsp, k)
    if _tiled(k, s, p, d, g.shape[-nsp:], x.shape[-nsp:]):
        return _tiled_backward(g, x, indices, k)
    return _index_backward(g, x, indices, nsp)


@lowering("aten::max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(g, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(g, x, kernel_size, stride, padding, dilation, indices, 2)


@lowering("aten::max_pool3d_with_indices_backward")
def max_pool3d_with_indices_backward(g, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(g, x, kernel_size, stride, padding, dilation, indices, 3)


def _avg_pool_fn(xshape, osz, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nsp):
    k = _tup(kernel_size, nsp)
    s = _tup(stride, nsp, k)
    p = _tup(padding, nsp)
    isz = xshape[-nsp:]
    idxs, valids, divs = [], [], []
    for i in range(nsp):
        idx, valid = _window_index(isz[i], osz[i], k[i], s[i], p[i], 1)
        idxs.append(idx)
        valids.append(valid)
        start = np.arange(osz[i]) * s[i] - p[i]
        end = np.minimum(start + k[i], isz[i] + p[i])
        if count_include_pad:
            divs.append((end - start).astype(np.float64))
        else:
            divs.append((np.minimum(end, isz[i]) - np.maximum(start, 0)).astype(np.float64))
    valid = _combine_valid(valids)
    if divisor_override:
        div = np.full(tuple(osz), float(divisor_override))
    else:
        div = np.ones(())
        for i, dv in enumerate(divs):
            shape = [1] * nsp
            shape[i] = osz[i]
            div = div * dv.reshape(shape)

    def f(x):
        win = _gather_windows(x, idxs)
        tot = jnp.sum(jnp.where(valid, win, jnp.zeros((), x.dtype)), axis=-1)
        return tot / jnp.asarray(div, x.dtype)
    return f


@lowering("aten::avg_pool2d")
def avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    x32 = _opmath(x)
    return _avg_pool_fn(x.shape, out_shape()[-2:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override, 2)(x32)


@lowering("aten::avg_pool3d")
def avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    x32 = _opmath(x)
    return _avg_pool_fn(x.shape, out_shape()[-3:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override, 3)(x32)


def _avg_pool_backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nsp):
    f = _avg_pool_fn(x.shape, g.shape[-nsp:], kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, nsp)
    g32 = _opmath(g)
    _, vjp = jax.vjp(f, jnp.zeros(x.shape, g32.dtype))
    return vjp(g32)[0]


@lowering("aten::avg_pool2d_backward")
def avg_pool2d_backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override, 2)


@lowering("aten::avg_pool3d_backward")
def avg_pool3d_backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(g, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override, 3)


# ---- adaptive pooling -----------------------------------------------------------------

def _adaptive_bounds(in_size, out_size):
    o = np.arange(out_size)
    start = (o * in_size) // out_size
    end = -((-(o + 1) * in_size) // out_size)
    return start, end


def _adaptive_matrix(in_size, out_size):
    start, end = _adaptive_bounds(in_size, out_size)
    m = np.zeros((out_size, in_size))
    for i in range(out_size):
        m[i, start[i]:end[i]] = 1.0 / (end[i] - start[i])
    return m


def _adaptive_avg(x, osz):
    nsp = len(osz)
    y = x
    for i in range(nsp):
        ax = x.ndim - nsp + i
        m = jnp.asarray(_adaptive_matrix(x.shape[ax], osz[i]), y.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([ax], [1]), precision=_HI), -1, ax)
    return y


@lowering("aten::_adaptive_avg_pool2d", "aten::_adaptive_avg_pool3d")
def adaptive_avg_pool(x, output_size):
    nsp = len(output_size)
    return _adaptive_avg(_opmath(x), tuple(out_shape()[-nsp:]))


def _adaptive_avg_backward(g, x, nsp):
    g32 = _opmath(g)
    _, vjp = jax.vjp(lambda t: _adaptive_avg(t, g.shape[-nsp:]), jnp.zeros(x.shape, g32.dtype))
    return vjp(g32)[0]


@lowering("aten::_adaptive_avg_pool2d_backward")
def adaptive_avg_pool2d_backward(g, x):
    return _adaptive_avg_backward(g, x, 2)


@lowering("aten::_adaptive_avg_pool3d_backward")
def adaptive_avg_pool3d_backward(g, x):
    return _adaptive_avg_backward(g, x, 3)


def _adaptive_windows(isz, osz):
    idxs, valids = [], []
    for i in range(len(osz)):
        start, end = _adaptive_bounds(isz[i], osz[i])
        k = int((end - start).max())
        idx = start[:, None] + np.arange(k)[None, :]
        valid = idx < end[:, None]
        idxs.append(np.clip(idx, 0, isz[i] - 1))
        valids.append(valid)
    return idxs, valids


@lowering("aten::adaptive_max_pool2d", "aten::adaptive_max_pool3d")
def adaptive_max_pool(x, output_size):
    nsp = len(output_size)
    osz = tuple(out_shape(0)[-nsp:])
    idxs, valids = _adaptive_windows(x.shape[-nsp:], osz)
    return _max_windows(x, idxs, valids)


@lowering("aten::adaptive_max_pool2d_backward")
def adaptive_max_pool2d_backward(g, x, indices):
    return _index_backward(g, x, indices, 2)


@lowering("aten::adaptive_max_pool3d_backward")
def adaptive_max_pool3d_backward(g, x, indices):
    return _index_backward(g, x, indices, 3)


# ---- normalization ---------------------------------------------------------------------

def _bshape(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _bn_forward(x, w, b, rm, rv, training, momentum, eps):
    x = _opmath(x)
    axes = (0,) + tuple(range(2, x.ndim))
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - _bshape(mean, x.ndim)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        n = x.size // x.shape[1]
        new_rm = new_rv = None
        if rm is not None:
            new_rm = (1 - momentum) * rm + momentum * mean.astype(rm.dtype)
        if rv is not None:
            unbiased = var * (n / max(n - 1, 1)) if n > 1 else var * jnp.nan
            new_rv = (1 - momentum) * rv + momentum * unbiased.astype(rv.dtype)
        use_mean, use_invstd = mean, invstd
    else:
        use_mean = rm.astype(x.dtype)
        use_invstd = lax.rsqrt(rv.astype(x.dtype) + eps)
        mean, invstd, new_rm, new_rv = None, None, rm, rv
    y = (x - _bshape(use_mean, x.ndim)) * _bshape(use_invstd, x.ndim)
    if w is not None:
        y = y * _bshape(w.astype(x.dtype), x.ndim)
    if b is not None:
        y = y + _bshape(b.astype(x.dtype), x.ndim)
    return y, mean, invstd, new_rm, new_rv


def _saved(v, i):
    """A saved-statistics output: empty when PyTorch returns an empty tensor."""
    shp = out_shape(i)
    if v is None or tuple(shp) != tuple(v.shape):
        return jnp.zeros(shp, out_dtype(i))
    return v


def native_batch_norm(x, w, b, rm, rv, training, momentum, eps):
    y, mean, invstd, _, _ = _bn_forward(x, w, b, rm, rv, training, momentum, eps)
    return y, _saved(mean, 1), _saved(invstd, 2)


def _meta_bn_functional(x, w, b, rm, rv, training, momentum, eps):
    # As the CPU kernel: saved statistics in the running statistics' dtype, empty when
    # not training (PyTorch's meta kernel says (C,) in the opmath dtype).
    c = x.shape[1] if x.dim() > 1 else 0
    st = torch.empty((c if training else 0,), dtype=rm.dtype if rm is not None else x.dtype, device="meta")
    return torch.empty_like(x), st, st.clone(), torch.empty_like(rm), torch.empty_like(rv)


@lowering("aten::_native_batch_norm_legit_functional", meta=_meta_bn_functional)
def native_batch_norm_legit_functional(x, w, b, rm, rv, training, momentum, eps):
    y, mean, invstd, nrm, nrv = _bn_forward(x, w, b, rm, rv, training, momentum, eps)
    return y, _saved(mean, 1), _saved(invstd, 2), nrm, nrv


@lowering("aten::_native_batch_norm_legit.no_stats")
def native_batch_norm_legit_no_stats(x, w, b, training, momentum, eps):
    y, mean, invstd, _, _ = _bn_forward(x, w, b, None, None, True, momentum, eps)
    return y, _saved(mean, 1), _saved(invstd, 2)


@lowering("aten::_native_batch_norm_legit_no_training")
def native_batch_norm_legit_no_training(x, w, b, rm, rv, momentum, eps):
    y, _, _, _, _ = _bn_forward(x, w, b, rm, rv, False, momentum, eps)
    return y, _saved(None, 1), _saved(None, 2)


def _bn_backward(g, x, w, rm, rv, save_mean, save_invstd, train, eps, is_var=False):
    x = _opmath(x)
    g = _opmath(g).astype(x.dtype)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean = save_mean.astype(x.dtype)
        invstd = save_invstd.astype(x.dtype)
        if is_var:
            invstd = lax.rsqrt(invstd + eps)
    else:
        mean = rm.astype(x.dtype)
        invstd = lax.rsqrt(rv.astype(x.dtype) + eps)
    xhat = (x - _bshape(mean, x.ndim)) * _bshape(invstd, x.ndim)
    wv = jnp.ones((x.shape[1],), x.dtype) if w is None else w.astype(x.dtype)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    gx = None
    if _has_out(0):
        if train:
            n = x.size // x.shape[1]
            gx = _bshape(wv * invstd / n, x.ndim) * (n * g - _bshape(sum_g, x.ndim) - xhat * _bshape(sum_gx, x.ndim))
        else:
            gx = g * _bshape(wv * invstd, x.ndim)
    gw = sum_gx if _has_out(1) else None
    gb = sum_g if _has_out(2) else None
    return gx, gw, gb


@lowering("aten::native_batch_norm_backward", meta=_meta_fill("native_batch_norm_backward"))
def native_batch_norm_backward(g, x, w, rm, rv, save_mean, save_invstd, train, eps, output_mask):
    return _fill(_bn_backward(g, x, w, rm, rv, save_mean, save_invstd, train, eps))


@lowering("aten::batch_norm_backward", meta=_meta_fill("batch_norm_backward"))
def batch_norm_backward(g, x, w, rm, rv, save_mean, save_var, update, eps, output_mask, reserve):
    # save_var holds the saved inverse std (as in native_batch_norm)
    return _fill(_bn_backward(g, x, w, rm, rv, save_mean, save_var, update, eps))


@lowering("aten::native_layer_norm")
def native_layer_norm(x, normalized_shape, w, b, eps):
    x = _opmath(x)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    y = (x - mean) * rstd
    if w is not None:
        y = y * w.astype(x.dtype)
    if b is not None:
        y = y + b.astype(x.dtype)
    return y, mean, rstd


@lowering("aten::native_layer_norm_backward", meta=_meta_fill("native_layer_norm_backward"))
def native_layer_norm_backward(g, x, normalized_shape, mean, rstd, w, b, output_mask):
    x = _opmath(x)
    g = _opmath(g).astype(x.dtype)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    mean = mean.astype(x.dtype)
    rstd = rstd.astype(x.dtype)
    xhat = (x - mean) * rstd
    gxh = g if w is None else g * w.astype(x.dtype)
    gx = None
    if _has_out(0):
        gx = rstd * (gxh - jnp.mean(gxh, axis=axes, keepdims=True)
                     - xhat * jnp.mean(gxh * xhat, axis=axes, keepdims=True))
    gw = jnp.sum(g * xhat, axis=lead) if _has_out(1) else None
    gb = jnp.sum(g, axis=lead) if _has_out(2) else None
    return _fill((gx, gw, gb))


@lowering("aten::native_group_norm")
def native_group_norm(x, w, b, N, C, HxW, group, eps):
    x = _opmath(x)
    shape = x.shape
    xg = x.reshape((N, group, -1))
    mean = jnp.mean(xg, axis=-1)
    var = jnp.mean(jnp.square(xg - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    y = ((xg - mean[..., None]) * rstd[..., None]).reshape((N, C, -1))
    if w is not None:
        y = y * w.astype(x.dtype)[None, :, None]
    if b is not None:
        y = y + b.astype(x.dtype)[None, :, None]
    return y.reshape(shape), mean, rstd


@lowering("aten::native_group_norm_backward", meta=_meta_fill("native_group_norm_backward"))
def native_group_norm_backward(g, x, mean, rstd, w, N, C, HxW, group, output_mask):
    x = _opmath(x)
    g = _opmath(g).astype(x.dtype)
    shape = x.shape
    x3 = x.reshape((N, C, -1))
    g3 = g.reshape((N, C, -1))
    cg = C // group
    mean_c = jnp.repeat(mean.astype(x.dtype), cg, axis=1)[..., None]
    rstd_c = jnp.repeat(rstd.astype(x.dtype), cg, axis=1)[..., None]
    xhat = (x3 - mean_c) * rstd_c
    gw = jnp.sum(g3 * xhat, axis=(0, 2)) if _has_out(1) else None
    gb = jnp.sum(g3, axis=(0, 2)) if _has_out(2) else None
    gx = None
    if _has_out(0):
        gxh = g3 if w is None else g3 * w.astype(x.dtype)[None, :, None]
        gxh_g = gxh.reshape((N, group, -1))
        xhat_g = xhat.reshape((N, group, -1))
        r = rstd.astype(x.dtype)[..., None]
        gx = r * (gxh_g - jnp.mean(gxh_g, axis=-1, keepdims=True)
                  - xhat_g * jnp.mean(gxh_g * xhat_g, axis=-1, keepdims=True))
        gx = gx.reshape(shape)
    return _fill((gx, gw, gb))


@lowering("aten::_fused_rms_norm")
def fused_rms_norm(x, normalized_shape, w, eps):
    x32 = _opmath(x)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    if eps is None:
        eps = float(jnp.finfo(x.dtype).eps) if jnp.issubdtype(x.dtype, jnp.floating) else 1e-6
    rstd = lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + eps)
    y = x32 * rstd
    if w is not None:
        y = y * w.astype(y.dtype)
    return y, rstd


@lowering("aten::_fused_rms_norm_backward", meta=_meta_fill("_fused_rms_norm_backward"))
def fused_rms_norm_backward(g, x, normalized_shape, rstd, w, output_mask):
    x32 = _opmath(x)
    g = _opmath(g).astype(x32.dtype)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    rstd = rstd.astype(x32.dtype)
    xhat = x32 * rstd
    gx = gw = None
    if _has_out(0):
        gxh = g if w is None else g * w.astype(x32.dtype)
        gx = rstd * (gxh - xhat * jnp.mean(gxh * xhat, axis=axes, keepdims=True))
    if _has_out(1) and w is not None:
        gw = jnp.sum(g * xhat, axis=lead)
    return _fill((gx, gw))


# ---- embedding -------------------------------------------------------------------------

def _embedding_meta(w, indices, *rest):
    if w.dim() != 2:
        raise RuntimeError("'weight' must be 2-D")
    return torch.ops.aten.embedding.default(w, indices, *rest)


@lowering("aten::embedding", meta=_embedding_meta)
def embedding(w, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(w, indices, axis=0)


@lowering("aten::embedding_dense_backward")
def embedding_dense_backward(g, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    gf = g.reshape((idx.shape[0], -1))
    gf = _opmath(gf)
    if padding_idx is not None and padding_idx >= 0:
        gf = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), gf.dtype), gf)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), gf.dtype).at[idx].add(1)
        gf = gf / counts[idx][:, None]
    return jnp.zeros((num_weights, gf.shape[1]), gf.dtype).at[idx].add(gf)


@lowering("aten::embedding_renorm")
def embedding_renorm(w, indices, max_norm, norm_type):
    """Rows of w named in indices whose norm exceeds max_norm are scaled down to it."""
    idx = indices.reshape(-1)
    hit = jnp.zeros((w.shape[0],), jnp.bool_).at[idx].set(True)
    wf = _opmath(w)
    if norm_type == 2:
        norm = jnp.sqrt(jnp.sum(jnp.square(wf), axis=1))
    elif math.isinf(norm_type):
        norm = jnp.max(jnp.abs(wf), axis=1)
    else:
        norm = jnp.sum(jnp.abs(wf) ** norm_type, axis=1) ** (1.0 / norm_type)
    scale = jnp.where(hit & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return (wf * scale[:, None].astype(wf.dtype)).astype(w.dtype)


# ---- losses ----------------------------------------------------------------------------

def _nll_parts(x, target, weight, ignore_index):
    """Per-element gathered -x[target] weights (class axis 1, or 0 for 1-D input)."""
    cax = 0 if x.ndim == 1 else 1
    C = x.shape[cax]
    valid = target != ignore_index
    t = jnp.where(valid, target, 0).astype(jnp.int64)
    w = jnp.ones((C,), x.dtype) if weight is None else weight.astype(x.dtype)
    wt = jnp.where(valid, jnp.take(w, t), jnp.zeros((), x.dtype))
    return cax, t, wt


@lowering("aten::nll_loss_forward", "aten::nll_loss2d_forward")
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    cax, t, wt = _nll_parts(x, target, weight, ignore_index)
    picked = jnp.take_along_axis(x, jnp.expand_dims(t, cax), axis=cax)
    picked = jnp.squeeze(picked, cax)
    loss = -picked * wt
    total = jnp.sum(wt)
    if reduction == 0:
        return loss, jnp.zeros((), x.dtype) if not _has_out(1) or out_shape(1) == () else jnp.zeros(out_shape(1))
    if reduction == 2:
        return jnp.sum(loss), total
    return jnp.sum(loss) / total, total


@lowering("aten::nll_loss_backward", "aten::nll_loss2d_backward")
def nll_loss_backward(g, x, target, weight, reduction, ignore_index, total_weight):
    cax, t, wt = _nll_parts(x, target, weight, ignore_index)
    if reduction == 1:
        g = g / total_weight.astype(g.dtype)
    gsel = -wt * g
    onehot = jnp.arange(x.shape[cax]).reshape((-1,) + (1,) * (x.ndim - 1 - cax)) == jnp.expand_dims(t, cax)
    return jnp.where(onehot, jnp.expand_dims(gsel, cax), jnp.zeros((), x.dtype)).astype(x.dtype)


@lowering("aten::mse_loss")
def mse_loss(x, y, reduction=1):
    return _reduce(jnp.square(x - y), reduction)


@lowering("aten::mse_loss_backward")
def mse_loss_backward(g, x, y, reduction):
    return 2 * (x - y) * _grad_scale(g, x, reduction)


@lowering("aten::binary_cross_entropy")
def binary_cross_entropy(x, t, weight=None, reduction=1):
    lx = jnp.maximum(jnp.log(x), -100.0)
    l1x = jnp.maximum(jnp.log1p(-x), -100.0)
    loss = -(t * lx + (1 - t) * l1x)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


@lowering("aten::binary_cross_entropy_backward")
def binary_cross_entropy_backward(g, x, t, weight=None, reduction=1):
    gi = _grad_scale(g, x, reduction) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    if weight is not None:
        gi = gi * weight
    return gi


@lowering("aten::binary_cross_entropy_with_logits")
def binary_cross_entropy_with_logits(x, t, weight=None, pos_weight=None, reduction=1):
    sp = jnp.log1p(jnp.exp(-jnp.abs(x))) + jnp.maximum(-x, 0)  # softplus(-x)
    if pos_weight is not None:
        lw = (pos_weight - 1) * t + 1
        loss = (1 - t) * x + lw * sp
    else:
        loss = (1 - t) * x + sp
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def _smooth_l1(z, beta):
    a = jnp.abs(z)
    if beta == 0:
        return a
    return jnp.where(a < beta, 0.5 * z * z / beta, a - 0.5 * beta)


@lowering("aten::smooth_l1_loss")
def smooth_l1_loss(x, y, reduction=1, beta=1.0):
    return _reduce(_smooth_l1(x - y, beta), reduction)


@lowering("aten::smooth_l1_loss_backward")
def smooth_l1_loss_backward(g, x, y, reduction, beta):
    z = x - y
    if beta == 0:
        d = jnp.sign(z)
    else:
        d = jnp.where(jnp.abs(z) < beta, z / beta, jnp.sign(z))
    return d * _grad_scale(g, x, reduction)


@lowering("aten::huber_loss")
def huber_loss(x, y, reduction=1, delta=1.0):
    z = x - y
    a = jnp.abs(z)
    return _reduce(jnp.where(a < delta, 0.5 * z * z, delta * (a - 0.5 * delta)), reduction)


@lowering("aten::huber_loss_backward")
def huber_loss_backward(g, x, y, reduction, delta):
    return jnp.clip(x - y, -delta, delta) * _grad_scale(g, x, reduction)


@lowering("aten::soft_margin_loss")
def soft_margin_loss(x, y, reduction=1):
    return _reduce(jnp.log1p(jnp.exp(-y * x)), reduction)


@lowering("aten::soft_margin_loss_backward")
def soft_margin_loss_backward(g, x, y, reduction):
    e = jnp.exp(-y * x)
    return -y * e / (1 + e) * _grad_scale(g, x, reduction)


# ---- dropout ---------------------------------------------------------------------------

@lowering("aten::native_dropout", random=True)
def native_dropout(x, p, train, key=None):
    if train is False:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    scale = 1.0 / (1.0 - p)
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype)), keep


@lowering("aten::native_dropout_backward")
def native_dropout_backward(g, mask, scale):
    return g * mask.astype(g.dtype) * jnp.asarray(scale, g.dtype)


# ---- upsampling ------------------------------------------------------------------------

def _scale(in_size, out_size, scale, align_corners=False):
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    if scale is not None and scale > 0:
        return 1.0 / scale
    return in_size / out_size


def _nearest_index(in_size, out_size, scale, exact):
    o = np.arange(out_size)
    if not exact and out_size == in_size:
        return o
    if not exact and out_size == 2 * in_size:
        return o >> 1
    s = np.float32(_scale(in_size, out_size, scale))
    if exact:
        src = np.floor((o.astype(np.float32) + np.float32(0.5)) * s)
    else:
        src = np.floor(o.astype(np.float32) * s)
    return np.minimum(src.astype(np.int64), in_size - 1)


def _nearest(x, osz, scales, exact):
    nsp = len(osz)
    for i in range(nsp):
        ax = x.ndim - nsp + i
        idx = _nearest_index(x.shape[ax], osz[i], scales[i], exact)
        x = jnp.take(x, jnp.asarray(idx), axis=ax)
    return x


def _cubic_matrix(in_size, out_size, align_corners, scale):
    """Bicubic interpolation weights (A = -0.75, border taps clamped), as in PyTorch."""
    A = -0.75
    s = _scale(in_size, out_size, scale, align_corners)
    o = np.arange(out_size, dtype=np.float64)
    src = o * s if align_corners else (o + 0.5) * s - 0.5
    src = src.astype(np.float32).astype(np.float64)
    i0 = np.floor(src).astype(np.int64)
    t = src - i0

    def cc1(x):
        return ((A + 2) * x - (A + 3)) * x * x + 1

    def cc2(x):
        return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A
    coeffs = [cc2(t + 1), cc1(t), cc1(1 - t), cc2(2 - t)]
    m = np.zeros((out_size, in_size))
    for j, c in enumerate(coeffs):
        idx = np.clip(i0 - 1 + j, 0, in_size - 1)
        np.add.at(m, (np.arange(out_size), idx), c)
    return m


def _linear_matrix(in_size, out_size, align_corners, scale, cubic=False):
    if cubic:
        return _cubic_matrix(in_size, out_size, align_corners, scale)
    s = _scale(in_size, out_size, scale, align_corners)
    o = np.arange(out_size, dtype=np.float64)
    if align_corners:
        src = o * s
    else:
        src = np.maximum((o + 0.5) * s - 0.5, 0.0)
    src = src.astype(np.float32).astype(np.float64)
    i0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    l1 = src - i0
    l0 = 1.0 - l1
    m = np.zeros((out_size, in_size))
    m[np.arange(out_size), i0] += l0
    m[np.arange(out_size), i1] += l1
    return m


def _linear(x, osz, align_corners, scales, cubic=False):
    nsp = len(osz)
    y = x
    for i in range(nsp):
        ax = x.ndim - nsp + i
        m = jnp.asarray(_linear_matrix(x.shape[ax], osz[i], align_corners, scales[i], cubic), y.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([ax], [1]), precision=_HI), -1, ax)
    return y


def _scales(n, *s):
    s = list(s) + [None] * (n - len(s))
    return s[:n]


def _def_nearest(nsp, exact):
    base = "_upsample_nearest_exact" if exact else "upsample_nearest"
    name = f"aten::{base}{nsp}d"

    @lowering(name)
    def fwd(x, output_size, *scales):
        return _nearest(x, tuple(out_shape()[-nsp:]), _scales(nsp, *scales), exact)

    @lowering(f"aten::{base}{nsp}d_backward")
    def bwd(g, output_size, input_size, *scales):
        f = lambda t: _nearest(t, tuple(output_size), _scales(nsp, *scales), exact)
        g32 = _opmath(g)
        _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), g32.dtype))
        return vjp(g32)[0]


def _def_linear(nsp, base, cubic=False):
    name = f"aten::{base}"

    @lowering(name)
    def fwd(x, output_size, align_corners, *scales):
        return _linear(_opmath(x), tuple(out_shape()[-nsp:]), align_corners, _scales(nsp, *scales), cubic)

    @lowering(name + "_backward")
    def bwd(g, output_size, input_size, align_corners, *scales):
        f = lambda t: _linear(t, tuple(output_size), align_corners, _scales(nsp, *scales), cubic)
        g32 = _opmath(g)
        _, vjp = jax.vjp(f, jnp.zeros(tuple(input_size), g32.dtype))
        return vjp(g32)[0]


for _n in (1, 2, 3):
    _def_nearest(_n, False)
    _def_nearest(_n, True)
_def_linear(1, "upsample_linear1d")
_def_linear(2, "upsample_bilinear2d")
_def_linear(3, "upsample_trilinear3d")
_def_linear(2, "upsample_bicubic2d", cubic=True)


# ---- padding ---------------------------------------------------------------------------

def _pad_widths(ndim, padding):
    n = len(padding) // 2
    widths = [(0, 0)] * (ndim - n)
    for i in range(n):
        # padding lists the last dim first
        widths.append((int(padding[2 * (n - 1 - i)]), int(padding[2 * (n - 1 - i) + 1])))
    return widths


def _pad_index(n, lo, hi, mode):
    i = np.arange(-lo, n + hi)
    if mode == "edge":
        return np.clip(i, 0, n - 1)
    i = np.abs(i)  # reflect (PyTorch requires pad < n)
    return np.where(i >= n, 2 * (n - 1) - i, i)


def _pad(x, padding, mode):
    """Reflection / replication padding (negative amounts crop) as a gather per axis."""
    widths = _pad_widths(x.ndim, padding)
    for ax, (lo, hi) in enumerate(widths):
        if lo == 0 and hi == 0:
            continue
        x = jnp.take(x, jnp.asarray(_pad_index(x.shape[ax], lo, hi, mode)), axis=ax)
    return x


def _def_pad(kind, mode):
    for nsp in (1, 2, 3):
        name = f"aten::{kind}_pad{nsp}d"

        @lowering(name)
        def fwd(x, padding, _mode=mode):
            return _pad(x, padding, _mode)

        @lowering(name + "_backward")
        def bwd(g, x, padding, _mode=mode):
            g32 = _opmath(g)
            _, vjp = jax.vjp(lambda t: _pad(t, padding, _mode), jnp.zeros(x.shape, g32.dtype))
            return vjp(g32)[0]


_def_pad("reflection", "reflect")
_def_pad("replication", "edge")


# ---- im2col / col2im -------------------------------------------------------------------

def _im2col(x, kernel_size, dilation, padding, stride):
    k, d, p, s = _tup(kernel_size, 2), _tup(dilation, 2), _tup(padding, 2), _tup(stride, 2)
    H, W = x.shape[-2:]
    oh = (H + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (W + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    ih, vh = _window_index(H, oh, k[0], s[0], p[0], d[0])
    iw, vw = _window_index(W, ow, k[1], s[1], p[1], d[1])
    win = _gather_windows(x, [ih, iw])  # (..., C, oh, ow, kh*kw)
    valid = _combine_valid([vh, vw])
    win = jnp.where(valid, win, jnp.zeros((), x.dtype))
    lead = x.shape[:-3]
    C = x.shape[-3]
    win = jnp.moveaxis(win, -1, -3)  # (..., C, K, oh, ow)
    return win.reshape(lead + (C * k[0] * k[1], max(oh, 0) * max(ow, 0)))


@lowering("aten::im2col")
def im2col(x, kernel_size, dilation, padding, stride):
    return _im2col(x, kernel_size, dilation, padding, stride)


@lowering("aten::col2im")
def col2im(x, output_size, kernel_size, dilation, padding, stride):
    k = _tup(kernel_size, 2)
    lead = x.shape[:-2]
    C = x.shape[-2] // (k[0] * k[1])
    shape = lead + (C,) + tuple(int(o) for o in output_size)
    x32 = _opmath(x)
    _, vjp = jax.vjp(lambda t: _im2col(t, kernel_size, dilation, padding, stride), jnp.zeros(shape, x32.dtype))
    return vjp(x32)[0]


# ---- misc ------------------------------------------------------------------------------

@lowering("aten::glu")
def glu(x, dim=-1):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lowering("aten::glu_backward")
def glu_backward(g, x, dim):
    a, b = jnp.split(x, 2, axis=dim)
    sb = jax.nn.sigmoid(b)
    return jnp.concatenate([g * sb, g * a * sb * (1 - sb)], axis=dim)


@lowering("aten::_safe_softmax")
def safe_softmax(x, dim, dtype=None):
    dt = out_dtype()
    x = x.astype(dt) if dt is not None else x
    x = _opmath(x)
    m = jnp.max(x, axis=dim, keepdims=True)
    all_masked = jnp.isneginf(m)
    z = x - jnp.where(all_masked, jnp.zeros((), x.dtype), m)
    # exp as the last op, as in reductions.softmax: XLA keeps only the probabilities.
    y = jnp.exp(log_softmax_of(z, dim))
    return jnp.where(all_masked, jnp.zeros((), x.dtype), y)


@lowering("aten::pixel_shuffle")
def pixel_shuffle(x, r):
    lead = x.shape[:-3]
    C, H, W = x.shape[-3:]
    oc = C // (r * r)
    y = x.reshape(lead + (oc, r, r, H, W))
    n = len(lead)
    y = jnp.transpose(y, tuple(range(n)) + (n, n + 3, n + 1, n + 4, n + 2))
    return y.reshape(lead + (oc, H * r, W * r))


@lowering("aten::pixel_unshuffle")
def pixel_unshuffle(x, r):
    lead = x.shape[:-3]
    C, H, W = x.shape[-3:]
    y = x.reshape(lead + (C, H // r, r, W // r, r))
    n = len(lead)
    y = jnp.transpose(y, tuple(range(n)) + (n, n + 2, n + 4, n + 1, n + 3))
    return y.reshape(lead + (C * r * r, H // r, W // r))


@lowering("aten::_trilinear", promote=True)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of the three inputs, each unsqueezed at its `expand` dims
    (the kernel of nn.functional.bilinear)."""
    def unsq(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x
    p = unsq(i1, expand1) * unsq(i2, expand2) * unsq(i3, expand3)
    return jnp.sum(p, axis=tuple(sumdim)) if sumdim else p
