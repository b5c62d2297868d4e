"""Convolution on XLA's CPU backend: patches times weights (im2col) instead of XLA's
convolution.

XLA:CPU hands a convolution to Eigen's spatial convolution when it can and otherwise
emits a naive loop nest, many times slower than one matrix product of the patches: for
an input smaller than the kernel (ResNet's last stage), the input gradient of a strided
convolution (an lhs-dilated convolution) and one input channel (MNIST's first layer). So
every ungrouped convolution on CPU takes the patches, forward and backward (`jax.vjp` of
the same function, so they agree; the input gradient becomes slices and pads, never an
lhs-dilated convolution), except where the patch matrix would be large (big maps, where
Eigen does well). Other platforms always use `lax.conv_general_dilated`. Figures and the
formulations tried: BENCHMARKS.md, "Convolution formulations on XLA:CPU".
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import blas_cpu
from .table import ctx, matmul_precision

# Patch matrices above this stay with XLA's convolution (memory; Eigen does well on
# large maps).
PATCH_BYTES_MAX = 128 << 20


def _out_sizes(x_shape, k, stride, padding, dilation) -> tuple:
    """The output's spatial sizes for an (N, C, spatial...) input."""
    return tuple((n + 2 * p - d * (kk - 1) - 1) // s + 1
                 for n, kk, s, p, d in zip(x_shape[2:], k, stride, padding, dilation))


def _stacked_slices(xp, k, out, stride, dilation):
    """(c, k..., n, out...) from the padded input in (C, N, spatial...) order: k1 strided
    slices along the first spatial dimension, then k2 slices of those along the second,
    ...: k1 + k2 slices rather than one per kernel offset (k1 * k2)."""
    cur = xp
    for i in range(len(k)):
        ax = 2 + 2 * i      # after c, the i kernel axes stacked so far, n and i spatial axes
        cur = jnp.stack([lax.slice_in_dim(cur, off * dilation[i], off * dilation[i] + (out[i] - 1) * stride[i] + 1,
                                          stride[i], axis=ax) for off in range(k[i])], axis=1 + i)
    return cur


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _patches_of(xp, size, k, out, stride, dilation):
    return _stacked_slices(xp, k, out, stride, dilation)


def _patches_fwd(xp, size, k, out, stride, dilation):
    return _stacked_slices(xp, k, out, stride, dilation), None


def _patches_bwd(size, k, out, stride, dilation, _, g):
    # One sum, over the kernel offsets, of each offset's gradient slice padded (interior
    # padding = stride - 1) back to where it was cut: faster inside a step than jax's vjp
    # of the stacked slices (BENCHMARKS.md, "What moved the figures", fourth session).
    zero = jnp.zeros((), g.dtype)
    total = None
    for off in itertools.product(*(range(kk) for kk in k)):
        cfg = [(0, 0, 0), (0, 0, 0)]
        for i, o in enumerate(off):
            lo = o * dilation[i]
            cfg.append((lo, size[i] - lo - (out[i] - 1) * stride[i] - 1, stride[i] - 1))
        term = lax.pad(g[(slice(None),) + off], zero, cfg)
        total = term if total is None else total + term
    return (total,)


_patches_of.defvjp(_patches_fwd, _patches_bwd)


def _patches(xp, k, out, stride, dilation):
    """The patches of the padded (C, N, spatial...) input, (c, k..., n, out...), whose
    gradient is one sum over the kernel offsets."""
    return _patches_of(xp, tuple(xp.shape[2:]), tuple(k), tuple(out), tuple(stride), tuple(dilation))


# A weight gradient g·patchesᵀ whose reduction (images x output positions) is this many
# times its output (O x C*k) or more goes to the BLAS handler: XLA's product of such a
# long, narrow reduction took 1.8 ms for MNIST's first layer (a 10 x 73,728 by 73,728 x
# 25 product), the handler 0.7 (BENCHMARKS.md, issue 35, ninth session).
_LONG_REDUCTION = 32


def _long_weight_gradient(wm, pt) -> bool:
    """Whether the weight gradient of wm @ pt is the handler's (CPU executor programs only)."""
    if not ctx.library_products or not blas_cpu.large(wm, pt):
        return False
    return pt.shape[1] >= _LONG_REDUCTION * wm.shape[0] * wm.shape[1]


def _transposed_weights(wm):
    # Wᵀ as a matrix of its own: XLA otherwise folds the transpose into the product's
    # dimension numbers, a product XLA:CPU leaves to Eigen (MNIST's second convolution's
    # patch gradient: 0.74 ms) rather than to its library fusion (0.5 ms with the copy).
    return lax.optimization_barrier(wm.T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weights_times_patches(wm, pt, long_reduction):
    return jnp.matmul(wm, pt, precision=matmul_precision())


def _wp_fwd(wm, pt, long_reduction):
    return _weights_times_patches(wm, pt, long_reduction), (wm, pt)


def _wp_bwd(long_reduction, res, g):
    wm, pt = res
    if long_reduction:
        # g·ptᵀ by the handler, pt read transposed in place
        dw = blas_cpu.product(g, pt, False, True)
    else:
        # XLA's product: the handler's (lowering/blas_cpu.py) measured no faster here
        # (BENCHMARKS.md, issue 35, sixth session)
        dw = lax.dot_general(g, pt, (((1,), (1,)), ((), ())), precision=matmul_precision())
    return dw, jnp.matmul(_transposed_weights(wm), g, precision=matmul_precision())


_weights_times_patches.defvjp(_wp_fwd, _wp_bwd)


def conv_im2col(x, w, stride, padding, dilation):
    """The weights (O, C*k) times the transposed patch matrix (C*k, N*out).

    The patch matrix's rows are (channel, kernel offset) and its columns (image, output
    position), cut from the input in (C, N, spatial...) order: its contiguous runs are
    output rows (a channels-last matrix's are only C values long), and the weights
    multiply it as they are. Cutting one spatial dimension at a time gives XLA fewer,
    larger slices than one slice per kernel offset; the patches' gradient is one sum of
    padded slices (`_patches_bwd`). Measured against the alternatives: BENCHMARKS.md,
    "What moved the figures", fourth session."""
    n, c = x.shape[:2]
    o = w.shape[0]
    k = w.shape[2:]
    out = _out_sizes(x.shape, k, stride, padding, dilation)
    xp = jnp.pad(jnp.swapaxes(x, 0, 1), ((0, 0), (0, 0)) + tuple((p, p) for p in padding))
    pt = _patches(xp, k, out, stride, dilation).reshape((c * math.prod(k), n * math.prod(out)))
    wm = w.reshape((o, c * math.prod(k)))
    y = _weights_times_patches(wm, pt, _long_weight_gradient(wm, pt))
    return jnp.swapaxes(y.reshape((o, n) + out), 0, 1)


def dimension_numbers(nsp: int):
    """PyTorch's layouts (NC..., OI..., NC...) for `nsp` spatial dims."""
    sp = "DHW"[3 - nsp:]
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def conv_lax(x, w, stride, padding, dilation, groups=1):
    """XLA's own convolution in PyTorch's layouts."""
    return lax.conv_general_dilated(x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                    dimension_numbers=dimension_numbers(x.ndim - 2),
                                    feature_group_count=groups, precision=matmul_precision())


def use_im2col(x_shape, w_shape, stride, padding, dilation, itemsize: int = 4) -> bool:
    """Whether an ungrouped convolution on CPU is computed from its patch matrix."""
    k = w_shape[2:]
    extent = [d * (kk - 1) + 1 for kk, d in zip(k, dilation)]
    if any(n < e for n, e in zip(x_shape[2:], extent)):
        return True    # Eigen cannot take an input smaller than its kernel
    out = _out_sizes(x_shape, k, stride, padding, dilation)
    rows = x_shape[0] * math.prod(out)
    return rows * x_shape[1] * math.prod(k) * itemsize <= PATCH_BYTES_MAX


def _impl(x, w, stride, padding, dilation):
    if use_im2col(x.shape, w.shape, stride, padding, dilation, x.dtype.itemsize):
        return conv_im2col
    return conv_lax


def conv_forward(x, w, stride, padding, dilation):
    """An ungrouped forward convolution (NC..., OI...) in the CPU's better formulation.
    Its gradients are `jax.vjp` of this function (nn_ops.convolution_backward)."""
    return _impl(x, w, stride, padding, dilation)(x, w, stride, padding, dilation)
