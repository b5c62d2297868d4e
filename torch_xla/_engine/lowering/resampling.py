"""Resampling ops: upsampling (nearest, linear, bicubic, antialiased bilinear) and grid
sampling, forward and backward (the backward as `jax.vjp` of the forward lowering)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from .table import matmul_precision, lowering, out_shape
from .nn_common import _fill, _opmath


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
    # Source positions in float32 arithmetic, as PyTorch's CPU kernel computes them.
    s = np.float32(_scale(in_size, out_size, scale, align_corners))
    o = np.arange(out_size, dtype=np.float32)
    if align_corners:
        src = o * s
    else:
        src = np.maximum(s * (o + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    src = src.astype(np.float64)
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
        y = jnp.moveaxis(jnp.tensordot(y, m, axes=([ax], [1]), precision=matmul_precision()), -1, ax)
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


# ---- grid sampling -----------------------------------------------------------------------------
# interpolation_mode 0 bilinear (trilinear in 3-D), 1 nearest, 2 bicubic (2-D only);
# padding_mode 0 zeros, 1 border, 2 reflection, as PyTorch's grid_sampler kernels number them.

def _gs_unnormalize(g, size, align):
    return (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2


def _gs_reflect(c, twice_lo, twice_hi):
    if twice_lo == twice_hi:
        return jnp.zeros_like(c)
    lo, span = twice_lo / 2, (twice_hi - twice_lo) / 2
    c = jnp.abs(c - lo)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _gs_pad(c, size, padding, align):
    if padding == 1:
        return jnp.clip(c, 0, size - 1)
    if padding == 2:
        c = _gs_reflect(c, 0, 2 * (size - 1)) if align else _gs_reflect(c, -1, 2 * size - 1)
        return jnp.clip(c, 0, size - 1)
    return c


def _gs_cubic(t):
    """The four bicubic weights (A = -0.75, PyTorch's) of the taps at -1, 0, 1, 2."""
    a = -0.75

    def near(s):
        return ((a + 2) * s - (a + 3)) * s * s + 1

    def far(s):
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sample(x, grid, mode, padding, align):
    """PyTorch's grid_sampler_{2,3}d of x (N, C, *spatial) at grid (N, *out, nd), in the
    computation dtype of x."""
    nd = grid.shape[-1]
    sizes = x.shape[2:]
    n = x.shape[0]
    grid = grid.astype(x.dtype)
    coords = [_gs_unnormalize(grid[..., nd - 1 - d], sizes[d], align) for d in range(nd)]
    nidx = jnp.reshape(jnp.arange(n), (n,) + (1,) * (grid.ndim - 2))

    def tap(idx):
        valid = None
        clipped = []
        for d, i in enumerate(idx):
            ok = (i >= 0) & (i <= sizes[d] - 1)
            valid = ok if valid is None else valid & ok
            clipped.append(jnp.clip(i, 0, sizes[d] - 1).astype(jnp.int32))
        v = jnp.moveaxis(x[(nidx, slice(None)) + tuple(clipped)], -1, 1)
        return jnp.where(jnp.expand_dims(valid, 1), v, jnp.zeros((), x.dtype))

    if mode == 2:
        cx, cy = coords[1], coords[0]
        x0, y0 = jnp.floor(cx), jnp.floor(cy)
        wx, wy = _gs_cubic(cx - x0), _gs_cubic(cy - y0)
        out = 0
        for j in range(4):
            yj = _gs_pad(y0 - 1 + j, sizes[0], padding, align)
            row = 0
            for i in range(4):
                xi = _gs_pad(x0 - 1 + i, sizes[1], padding, align)
                row = row + jnp.expand_dims(wx[i], 1) * tap((jnp.round(yj), jnp.round(xi)))
            out = out + jnp.expand_dims(wy[j], 1) * row
        return out
    coords = [_gs_pad(c, sizes[d], padding, align) for d, c in enumerate(coords)]
    if mode == 1:
        return tap([jnp.round(c) for c in coords])
    lo = [jnp.floor(c) for c in coords]
    frac = [c - f for c, f in zip(coords, lo)]
    out = 0
    for corner in range(2 ** nd):
        w = 1
        idx = []
        for d in range(nd):
            hi = (corner >> (nd - 1 - d)) & 1
            w = w * (frac[d] if hi else 1 - frac[d])
            idx.append(lo[d] + hi)
        out = out + jnp.expand_dims(w, 1) * tap(idx)
    return out


@lowering("aten::grid_sampler_2d", "aten::grid_sampler_3d")
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(_opmath(x), grid, interpolation_mode, padding_mode, align_corners)


@lowering("aten::grid_sampler_2d_backward", "aten::grid_sampler_3d_backward")
def grid_sampler_backward(g, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    xc, gc = _opmath(x), _opmath(grid)
    _, vjp = jax.vjp(lambda a, b: _grid_sample(a, b, interpolation_mode, padding_mode, align_corners), xc, gc)
    gx, gg = vjp(_opmath(g).astype(xc.dtype))
    return _fill((gx if output_mask[0] else None, gg if output_mask[1] else None))


# ---- antialiased bilinear upsampling -----------------------------------------------------------

def _aa_matrix(in_size, out_size, align_corners, scale):
    """(out, in) weights of PyTorch's antialiased bilinear interpolation along one axis:
    a triangle filter widened by the downscaling factor, normalized per output."""
    s = _scale(in_size, out_size, scale, align_corners)
    support = s if s >= 1.0 else 1.0
    inv = 1.0 / s if s >= 1.0 else 1.0
    m = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        j = np.arange(lo, hi)
        w = np.maximum(1.0 - np.abs((j - center + 0.5) * inv), 0.0)
        total = w.sum()
        m[i, lo:hi] = w / total if total != 0 else w
    return m


def _aa_weights(in_hw, out_hw, align_corners, scales_h, scales_w):
    return (_aa_matrix(in_hw[0], out_hw[0], align_corners, scales_h),
            _aa_matrix(in_hw[1], out_hw[1], align_corners, scales_w))


def _aa_apply(x, mh, mw):
    y = jnp.einsum("...hw,oh->...ow", x, jnp.asarray(mh, x.dtype), precision=matmul_precision())
    return jnp.einsum("...hw,ow->...ho", y, jnp.asarray(mw, x.dtype), precision=matmul_precision())


@lowering("aten::_upsample_bilinear2d_aa")
def upsample_bilinear2d_aa(x, output_size, align_corners, scales_h=None, scales_w=None):
    mh, mw = _aa_weights(x.shape[-2:], tuple(out_shape()[-2:]), align_corners, scales_h, scales_w)
    return _aa_apply(_opmath(x), mh, mw)


@lowering("aten::_upsample_bilinear2d_aa_backward")
def upsample_bilinear2d_aa_backward(g, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    mh, mw = _aa_weights(tuple(input_size[-2:]), g.shape[-2:], align_corners, scales_h, scales_w)
    return _aa_apply(_opmath(g), mh.T, mw.T)
