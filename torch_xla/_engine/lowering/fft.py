"""Discrete Fourier transforms and complex views (view_as_real, view_as_complex).

PyTorch's `torch.fft.*` functions reduce to three aten ops, `_fft_r2c`, `_fft_c2c` and
`_fft_c2r`, which receive the dims to transform and a normalization mode (0 none,
1 by 1/sqrt(n), 2 by 1/n, n the product of the signal sizes) already resolved from the
user's `norm`. They lower to `lax.fft`, which transforms at most three trailing axes,
and whose inverse transforms are normalized by 1/n.

The conjugate and negative bits: PyTorch's `_conj` / `_neg_view` are aliases that flip a
bit on the tensor and rely on every kernel honouring it (copy_/clone/views are
fallthroughs of the Conjugate/Negative keys, so their backend kernels must resolve the
bit themselves). The engine's kernels read only the lazy value, so a set bit would be
silently dropped; here both ops are computed physically instead, and no XLA tensor ever
carries the bits.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from .table import lowering, out_dtype, out_shape

_FFT, _IFFT, _RFFT, _IRFFT = lax.FftType.FFT, lax.FftType.IFFT, lax.FftType.RFFT, lax.FftType.IRFFT
_MAX_RANK = 3  # lax.fft transforms at most three axes at once


def _dims(dim, ndim):
    return [d % ndim if ndim else 0 for d in dim]


def _scale(normalization, n):
    """The factor PyTorch's normalization mode applies to a transform over n points."""
    if normalization == 0:
        return 1.0
    if normalization == 1:
        return 1.0 / math.sqrt(n)
    return 1.0 / n


def _times(x, f):
    return x if f == 1 else x * jnp.asarray(f, dtype=x.real.dtype).astype(x.dtype)


def _complex_dtype(x):
    return jnp.complex128 if x.dtype in (jnp.float64, jnp.complex128) else jnp.complex64


def _on_trailing(x, axes, fn):
    """Moves `axes` to the end (in order), applies fn, moves them back."""
    k = len(axes)
    moved = jnp.moveaxis(x, axes, list(range(x.ndim - k, x.ndim)))
    y = fn(moved)
    return jnp.moveaxis(y, list(range(x.ndim - k, x.ndim)), axes)


def _c2c(x, axes, forward):
    """Unnormalized forward / 1/n-normalized inverse complex transform over `axes`."""
    kind = _FFT if forward else _IFFT
    for i in range(0, len(axes), _MAX_RANK):
        group = axes[i:i + _MAX_RANK]
        x = _on_trailing(x, group, lambda y: lax.fft(y, kind, tuple(y.shape[-len(group):])))
    return x


@lowering("aten::_fft_c2c")
def fft_c2c(x, dim, normalization, forward):
    axes = _dims(dim, x.ndim)
    if not axes:
        return x
    x = x.astype(_complex_dtype(x))
    n = math.prod(x.shape[a] for a in axes)
    y = _c2c(x, axes, forward)
    # lax's inverse already divides by n
    return _times(y, _scale(normalization, n) * (1 if forward else n))


@lowering("aten::_fft_r2c")
def fft_r2c(x, dim, normalization, onesided):
    axes = _dims(dim, x.ndim)
    n = math.prod(x.shape[a] for a in axes)
    if not onesided:
        return _times(_c2c(x.astype(_complex_dtype(x)), axes, True), _scale(normalization, n))
    # The real transform (halving the last axis) over the trailing group holding the last
    # axis, then complex transforms over the rest.
    real_axes, rest = axes[-_MAX_RANK:], axes[:-_MAX_RANK]
    y = _on_trailing(x, real_axes, lambda v: lax.fft(v, _RFFT, tuple(v.shape[-len(real_axes):])))
    if rest:
        y = _c2c(y, rest, True)
    return _times(y, _scale(normalization, n))


@lowering("aten::_fft_c2r")
def fft_c2r(x, dim, normalization, last_dim_size):
    axes = _dims(dim, x.ndim)
    x = x.astype(_complex_dtype(x))
    last = axes[-1]
    half = last_dim_size // 2 + 1
    # the transform reads exactly n//2+1 input points on the halved axis
    if x.shape[last] > half:
        x = lax.slice_in_dim(x, 0, half, axis=last)
    elif x.shape[last] < half:
        pad = [(0, 0)] * x.ndim
        pad[last] = (0, half - x.shape[last])
        x = jnp.pad(x, pad)
    real_axes, rest = axes[-_MAX_RANK:], axes[:-_MAX_RANK]
    if rest:
        x = _c2c(x, rest, False)
    lengths = tuple(x.shape[a] for a in real_axes[:-1]) + (last_dim_size,)
    y = _on_trailing(x, real_axes, lambda v: lax.fft(v, _IRFFT, lengths))
    n = math.prod(out_shape()[a] for a in axes)
    return _times(y, _scale(normalization, n) * n)  # lax's inverse already divides by n


# ---- complex views and the conjugate / negative bits --------------------------------------

@lowering("aten::view_as_real", "aten::view_as_real_copy")
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@lowering("aten::view_as_complex", "aten::view_as_complex_copy")
def view_as_complex(x):
    if x.dtype == jnp.float16:  # to complex32, held as complex64
        x = x.astype(jnp.float32)
    return lax.complex(x[..., 0], x[..., 1])


@lowering("aten::_conj", "aten::_conj_copy", "aten::conj_physical", "aten::_conj_physical")
def conj(x):
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


@lowering("aten::_neg_view", "aten::_neg_view_copy")
def neg_view(x):
    return -x


@lowering("aten::angle")
def angle(x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    x = x.astype(out_dtype()) if not jnp.issubdtype(x.dtype, jnp.floating) else x
    # PyTorch: pi for negative numbers, 0 otherwise (also for -0.0), NaN stays NaN
    pi = jnp.asarray(math.pi, x.dtype)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, pi, jnp.zeros((), x.dtype)))
