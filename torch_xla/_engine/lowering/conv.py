"""Convolutions, forward and backward (on CPU as patch products: conv_cpu.py)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import torch
from jax import lax

from . import conv_cpu
from .table import matmul_precision, ctx, lowering
from .nn_common import _fill, _has_out, _tup


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


def _expand(v, name: str, nsp: int) -> list:
    """A stride / padding / ... argument as one value per spatial dimension."""
    v = [int(a) for a in v] if isinstance(v, (list, tuple)) else [int(v)]
    if len(v) == 1:
        return v * nsp
    if len(v) != nsp:
        raise RuntimeError(f"expected {name} to be a single integer value or a list of {nsp} values to "
                           f"match the convolution dimensions, but got {name}={v}")
    return v


def conv_output_shape(x_shape, w_shape, b_shape, stride, padding, dilation, transposed: bool,
                      output_padding, groups: int) -> list:
    """The output shape of `aten::convolution`, checking its arguments as PyTorch's CPU kernel
    does, in its order and words (PyTorch's Python meta kernel leaves some of these checks out
    and words others differently, and costs more)."""
    xs, ws = list(x_shape), list(w_shape)
    nsp = len(ws) - 2
    if nsp <= 0:
        raise RuntimeError("weight should have at least three dimensions")
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    stride = _expand(stride, "stride", nsp)
    padding = _expand(padding, "padding", nsp)
    dilation = _expand(dilation, "dilation", nsp)
    output_padding = _expand(output_padding, "output_padding", nsp)
    if any(p < 0 for p in padding):
        raise RuntimeError("negative padding is not supported")
    if any(p < 0 for p in output_padding):
        raise RuntimeError("negative output_padding is not supported")
    if any(s <= 0 for s in stride):
        raise RuntimeError("non-positive stride is not supported")
    if any(d < 0 for d in dilation):
        raise RuntimeError("dilation should be greater than zero")
    if len(ws) != len(xs):
        raise RuntimeError(f"Expected {len(ws)}-dimensional input for {len(ws)}-dimensional weight {ws}, "
                           f"but got {len(xs)}-dimensional input of size {xs} instead")
    if ws[0] < groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be at least {groups} at dimension 0, "
                           f"but got weight of size {ws} instead")
    if ws[0] % groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at "
                           f"dimension 0, but got weight of size [{ws}] instead")
    bias_ok = b_shape is None or len(b_shape) == 1
    if not transposed:
        if xs[1] != ws[1] * groups:
            raise RuntimeError(f"Given groups={groups}, weight of size {ws}, expected input{xs} to have "
                               f"{ws[1] * groups} channels, but got {xs[1]} channels instead")
        if not (bias_ok and (b_shape is None or b_shape[0] == ws[0])):
            raise RuntimeError(f"Given weight of size {ws}, expected bias to be 1-dimensional with {ws[0]} "
                               f"elements, but got bias of size {list(b_shape)} instead")
        padded = [n + 2 * p for n, p in zip(xs[2:], padding)]
        kernel = [d * (k - 1) + 1 for k, d in zip(ws[2:], dilation)]
        if any(n < k for n, k in zip(padded, kernel)):
            raise RuntimeError(f"Calculated padded input size per channel: ({' x '.join(map(str, padded))}). "
                               f"Kernel size: ({' x '.join(map(str, kernel))}). Kernel size can't be greater "
                               f"than actual input size")
        out_channels = 0 if xs[1] == 0 else ws[0]
        spatial = conv_cpu._out_sizes(xs, ws[2:], stride, padding, dilation)
    else:
        if xs[1] != ws[0]:
            raise RuntimeError(f"Given transposed=1, weight of size {ws}, expected input{xs} to have {ws[0]} "
                               f"channels, but got {xs[1]} channels instead")
        if not (bias_ok and (b_shape is None or b_shape[0] == ws[1] * groups)):
            raise RuntimeError(f"Given transposed=1, weight of size {ws}, expected bias to be 1-dimensional "
                               f"with {ws[1] * groups} elements, but got bias of size {list(b_shape)} instead")
        out_channels = 0 if xs[1] == 0 else ws[1] * groups
        spatial = tuple((n - 1) * s - 2 * p + d * (k - 1) + op + 1 for n, k, s, p, d, op
                        in zip(xs[2:], ws[2:], stride, padding, dilation, output_padding))
    if any(d == 0 for d in dilation):
        raise RuntimeError("non-positive dilation is not supported")
    if transposed:
        _check_transposed(xs[2:], spatial, stride, dilation, output_padding)
    return [xs[0], out_channels, *spatial]


def _check_transposed(sizes, spatial, stride, dilation, output_padding) -> None:
    """The CPU kernels' checks of a transposed convolution, worded as they word them (a 1-d
    one as a 2-d one of height 1)."""
    lead = max(0, 2 - len(sizes))
    names = ("depth", "height", "width")[3 - len(sizes) - lead:]

    def named(what, vals, pad):
        return " ".join(f"{what}_{n}: {v}" for n, v in zip(names, [pad] * lead + list(vals)))

    if any(op >= s and op >= d for op, s, d in zip(output_padding, stride, dilation)):
        raise RuntimeError("output padding must be smaller than either stride or dilation, but got "
                           f"{named('output_padding', output_padding, 0)} {named('stride', stride, 1)} "
                           f"{named('dilation', dilation, 1)}")
    if any(n < 1 for n in spatial):
        raise RuntimeError(f"Given input size per channel: ({' x '.join(map(str, [1] * lead + list(sizes)))}). "
                           f"Calculated output size per channel: "
                           f"({' x '.join(map(str, [1] * lead + list(spatial)))}). Output size is too small")


def _conv_meta(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    shape = conv_output_shape(x.shape, w.shape, None if b is None else b.shape, stride, padding, dilation,
                              transposed, output_padding, groups)
    return torch.empty(shape, dtype=x.dtype, device="meta")


def _conv_backward_meta(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                        output_mask=(True, True, True)):
    # Each gradient has its operand's shape (the forward checked the arguments); an
    # unwanted one is the empty placeholder that `_has_out` recognises.
    shapes = (x.shape, w.shape, tuple(bias_sizes) if bias_sizes is not None else (w.shape[1] * groups
                                                                                 if transposed else w.shape[0],))
    return tuple(torch.empty(s if want else (0,), dtype=g.dtype, device="meta")
                 for s, want in zip(shapes, output_mask))


@lowering("aten::convolution", meta=_conv_meta)
def convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@lowering("aten::_convolution", meta=_conv_meta)
def convolution_(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@lowering("aten::convolution_overrideable", meta=_conv_meta)
def convolution_overrideable(x, w, b, stride, padding, dilation, transposed, output_padding, groups, *rest):
    return _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    y = _conv(x, w.astype(x.dtype), stride, padding, dilation, transposed, output_padding, groups)
    if b is not None:
        y = y + b.astype(y.dtype).reshape((1, -1) + (1,) * (y.ndim - 2))
    return y


@lowering("aten::convolution_backward", meta=_conv_backward_meta)
def convolution_backward(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                         output_mask=(True, True, True)):
    # _conv picks the CPU formulation itself: its vjp is that formulation's gradient.
    f = lambda xx, ww: _conv(xx, ww, stride, padding, dilation, transposed, output_padding, groups)
    _, vjp = jax.vjp(f, x, w.astype(x.dtype))
    gx, gw = vjp(g.astype(x.dtype))
    gb = jnp.sum(g, axis=(0,) + tuple(range(2, g.ndim))) if _has_out(2) else None
    return _fill((gx if _has_out(0) else None, gw if _has_out(1) else None, gb))
