"""Pooling (max, average, adaptive) and the window gathering it shares with im2col."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .table import lowering, matmul_precision, out_shape
from .nn_common import _opmath, _tup


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
    # The window's maximum is the element at `am` (NaN when the window holds one: XLA's
    # max propagates NaN): a max-reduction, not a gather, which XLA:CPU compiles in a
    # fraction of the time (its gather is fused into every consumer of the value).
    val = jnp.max(win, axis=-1)
    if tiled is not None:
        # The input position of window offset `am`, by arithmetic instead of a gather.
        k, osz = tiled
        # Unsigned division and remainder: `am` is never negative, and the sign handling
        # of a signed floor division is recomputed for each input element where the
        # gradient fuses it (MNIST's pool gradient: 0.73 -> 0.48 ms).
        am = am.astype(jnp.uint32)
        ind = jnp.zeros((), jnp.int64)
        for i in range(n):
            r = lax.rem(lax.div(am, np.uint32(np.prod(k[i + 1:]))), np.uint32(k[i])).astype(jnp.int64)
            shape = [1] * n
            shape[i] = osz[i]
            pos = jnp.asarray(np.arange(osz[i]).reshape(shape) * k[i]) + r
            ind = ind + pos * int(np.prod(in_sizes[i + 1:]))
        return val, ind
    flat = jnp.asarray(_flat_index(idxs, in_sizes))
    flat_b = jnp.broadcast_to(flat, am.shape + flat.shape[-1:])
    ind = jnp.take_along_axis(flat_b, am[..., None], axis=-1)[..., 0]
    return val, ind.astype(jnp.int64)


# Kernels with more offsets than this gather their windows: the offsets' chain of slices
# and selects is unrolled into the program, and XLA's compile time grows fast with it (a
# 13x13 kernel: 0.9 s against 0.16 s; 31x31 did not finish in 15 minutes).
_MAX_UNROLLED_OFFSETS = 25


def _max_by_offsets(x, k, s, p, d, osz, idxs, valids):
    """Max over windows and the flat input-plane index of the max, one kernel offset at a
    time: each offset's elements are one strided slice of the padded input, and the running
    maximum takes an element greater than it or NaN, in window order (the CPU kernel's
    rule: the first maximum, or the window's last NaN). Elementwise work on the output's
    size, where gathering every window (K times the output) and reducing it took XLA:CPU
    tens of milliseconds for the ResNet's 3x3/2 stem pool (BENCHMARKS.md, issue 35, ninth
    session). `idxs`, `valids`: `_window_index`'s per dimension."""
    n = len(k)
    lead = x.ndim - n
    isz = x.shape[lead:]
    # padding after the input, up to the last position the last window reads
    hi = [max(0, (osz[i] - 1) * s[i] - p[i] + (k[i] - 1) * d[i] + 1 - isz[i]) for i in range(n)]
    lowest = _lowest(x.dtype)
    xp = jnp.pad(x, [(0, 0)] * lead + [(p[i], hi[i]) for i in range(n)], constant_values=lowest)
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    val = ind = None
    for off in itertools.product(*(range(kk) for kk in k)):
        start = [0] * lead + [off[i] * d[i] for i in range(n)]
        limit = list(x.shape[:lead]) + [off[i] * d[i] + (osz[i] - 1) * s[i] + 1 for i in range(n)]
        v = lax.slice(xp, start, limit, [1] * lead + list(s))
        valid = np.ones((), bool)
        pos = np.zeros((), np.int64)
        for i in range(n):
            shape = [1] * n
            shape[i] = osz[i]
            valid = valid & valids[i][:, off[i]].reshape(shape)
            pos = pos + idxs[i][:, off[i]].reshape(shape).astype(np.int64) * int(np.prod(isz[i + 1:]))
        valid, pos = np.broadcast_to(valid, tuple(osz)), np.broadcast_to(pos, tuple(osz))
        if val is None:
            # the first offset: its valid elements start the running maximum
            val = jnp.where(valid, v, lowest)
            ind = jnp.broadcast_to(jnp.where(valid, jnp.asarray(pos), jnp.asarray(-1, jnp.int64)), val.shape)
            continue
        take = (v > val) | (ind < 0)
        if floating:
            take = take | jnp.isnan(v)
        if not valid.all():
            take = take & valid
        val = jnp.where(take, v, val)
        ind = jnp.where(take, jnp.asarray(pos), ind)
    return val, ind


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nsp):
    k = _tup(kernel_size, nsp)
    s = _tup(stride, nsp, k)
    p = _tup(padding, nsp)
    d = _tup(dilation, nsp)
    osz = out_shape(0)[-nsp:]
    isz = x.shape[-nsp:]
    idxs, valids = zip(*[_window_index(isz[i], osz[i], k[i], s[i], p[i], d[i]) for i in range(nsp)])
    if _tiled(k, s, p, d, osz, isz):
        return _max_windows(x, list(idxs), list(valids), (k, osz))
    if int(np.prod(k)) <= _MAX_UNROLLED_OFFSETS:
        return _max_by_offsets(x, k, s, p, d, osz, idxs, valids)
    return _max_windows(x, list(idxs), list(valids))


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
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([ax], [1]), precision=matmul_precision()), -1, ax)
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
