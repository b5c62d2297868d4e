"""Convolutions, forward and backward (on CPU as patch products: conv_cpu.py)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import torch
from jax import lax

from . import conv_cpu
from .table import matmul_precision, ctx, lowering
from .nn_common import _fill, _has_out, _meta_fill, _tup


# ---- convolution -----------------------------------------------------------------------

def _cpu_formulation(x, transposed, groups) -> bool:
    """Whether conv_cpu's formulations apply: the platform asks for them (XLA:CPU),
    ungrouped, real floating point."""
    return (ctx.patch_convolutions and not transposed and groups == 1 and 1 <= x.ndim - 2 <= 3
            and jnp.issubdtype(x.dtype, jnp.floating))


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    nsp = x.ndim - 2
    stride, padding, dilation = _tup(stride, nsp), _tup(padding, nsp), _tup(dilation, nsp)
    prec = matmul_precision()
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
