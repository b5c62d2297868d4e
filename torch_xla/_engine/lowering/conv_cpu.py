"""Convolution on XLA's CPU backend: patches times weights (im2col) instead of XLA's
convolution.

XLA:CPU hands a convolution to Eigen's spatial convolution when it can and otherwise
emits a naive loop nest. Measured on this project's 2-core machine
(`bench/bench_conv.py`), XLA's convolution is 1.5-70x slower than one matrix product of
the patches in the cases that matter:

- an input smaller than the kernel (ResNet's last stage: 2x2 maps, 3x3 kernels): a
  32x512x2x2 forward takes 419 ms, as a matrix product 9.5 ms;
- the input gradient of a strided convolution (an lhs-dilated convolution): 108 ms vs
  8.5 ms;
- one input channel (MNIST's first layer): its input gradient 16.4 vs 4.1 ms.

Whole steps (`bench/bench_training.py`): MNIST 1.0x -> 1.5-1.9x the original torch_xla,
ResNet-18 at 64x64 15.6 -> 56 samples/s. A shifted-slices sum for one input channel was faster alone but slower inside the MNIST
step, so every ungrouped convolution on CPU takes the patches, forward and backward
(`jax.vjp` of the same function, so they agree; the input gradient becomes slices and
pads, never an lhs-dilated convolution). Only where the patch matrix would be large (big
maps, where Eigen does well) does the convolution stay XLA's. Other platforms always use
`lax.conv_general_dilated`.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST
# Patch matrices above this stay with XLA's convolution (memory; Eigen does well on
# large maps).
PATCH_BYTES_MAX = 128 << 20


def _out_size(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _patches(xp, k, out, stride, dilation):
    """(n, out..., k..., c) from the padded channels-last input: k1 strided slices along
    the first spatial dimension, then k2 slices of those along the second, ...: k1 + k2
    slices rather than one per kernel offset (k1 * k2)."""
    cur = xp
    for i in range(len(k)):
        cur = jnp.stack([lax.slice_in_dim(cur, off * dilation[i], off * dilation[i] + (out[i] - 1) * stride[i] + 1,
                                          stride[i], axis=1 + i) for off in range(k[i])], axis=-2)
    return cur


def conv_im2col(x, w, stride, padding, dilation):
    """Patches of the channels-last input times the weights.

    Cutting the patches one spatial dimension at a time gives XLA fewer, larger slices
    than one slice per kernel offset: `bench/bench_patches.py` (both in one process)
    measured the MNIST training step at 25.1 -> 20.9 ms and its compilation at 4.75 ->
    2.56 s; ResNet-18's step within this machine's noise (three runs: +7%, +2%, -2%), its
    compilation 8-23% shorter."""
    nsp = x.ndim - 2
    n, c = x.shape[:2]
    o = w.shape[0]
    k = w.shape[2:]
    out = tuple(_out_size(x.shape[2 + i], k[i], stride[i], padding[i], dilation[i]) for i in range(nsp))
    xp = jnp.pad(jnp.moveaxis(x, 1, -1), ((0, 0),) + tuple((p, p) for p in padding) + ((0, 0),))
    patches = _patches(xp, k, out, stride, dilation).reshape((n * math.prod(out), math.prod(k) * c))
    # (O, C, k...) -> (k..., C, O): the order of the patch matrix's columns.
    wm = jnp.moveaxis(w, (0, 1), (-1, -2)).reshape((math.prod(k) * c, o))
    y = jnp.matmul(patches, wm, precision=_HI).reshape((n,) + out + (o,))
    return jnp.moveaxis(y, -1, 1)


def dimension_numbers(nsp: int):
    """PyTorch's layouts (NC..., OI..., NC...) for `nsp` spatial dims."""
    sp = "DHW"[3 - nsp:]
    return ("NC" + sp, "OI" + sp, "NC" + sp)


def conv_lax(x, w, stride, padding, dilation, groups=1):
    """XLA's own convolution in PyTorch's layouts."""
    return lax.conv_general_dilated(x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation,
                                    dimension_numbers=dimension_numbers(x.ndim - 2),
                                    feature_group_count=groups, precision=_HI)


def use_im2col(x_shape, w_shape, stride, padding, dilation, itemsize: int = 4) -> bool:
    """Whether an ungrouped convolution on CPU is computed from its patch matrix."""
    k = w_shape[2:]
    extent = [d * (kk - 1) + 1 for kk, d in zip(k, dilation)]
    if any(n < e for n, e in zip(x_shape[2:], extent)):
        return True    # Eigen cannot take an input smaller than its kernel
    out = [_out_size(n, kk, s, p, d) for n, kk, s, p, d in zip(x_shape[2:], k, stride, padding, dilation)]
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
