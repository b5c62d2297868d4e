"""Neural-network ops: normalization, embedding, losses, dropout,
padding, im2col/col2im and attention helpers (forward and backward); upsampling and grid
sampling are in resampling.py.

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

from .table import check_range, check_whole, lowering, out_dtype, out_shape
from .reductions import log_softmax_of
from .nn_common import _fill, _grad_scale, _has_out, _meta_fill, _opmath, _reduce, _tup
from .pooling import _combine_valid, _gather_windows, _window_index


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


def _meta_layer_norm(x, normalized_shape, w, b, eps):
    """PyTorch's meta kernel, with mean and rstd in the input's dtype as the CPU returns
    them (the meta kernel gives CUDA's float32 for reduced-precision inputs)."""
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, normalized_shape, w, b, eps)
    return y, mean.to(x.dtype), rstd.to(x.dtype)


@lowering("aten::native_layer_norm", meta=_meta_layer_norm)
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


@lowering("aten::embedding", meta=_embedding_meta, checked=True)
def embedding(w, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    check_range(indices, w.shape[0], IndexError, "index out of range in self", nonneg=True)
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
    if jnp.issubdtype(target.dtype, jnp.floating):
        # A floating label names class k when it equals k; any other value names none.
        valid = valid & (target == jnp.floor(target))
    t = jnp.where(valid, target, 0).astype(jnp.int64)
    w = jnp.ones((C,), x.dtype) if weight is None else weight.astype(x.dtype)
    wt = jnp.where(valid, jnp.take(w, t), jnp.zeros((), x.dtype))
    return cax, t, wt


_SCALAR_TYPE = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
                torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}


def _nll_outputs(x, target, reduction, out_shape):
    # Class indices: Long or Byte as on the CPU, or floating as PyTorch/XLA takes them
    # (`zeros(n)` targets are common in its users' code; each value must be whole).
    if target.dtype not in (torch.int64, torch.uint8) and not target.dtype.is_floating_point:
        raise RuntimeError("expected target dtype to be Long or Byte, but got "
                           f"{_SCALAR_TYPE.get(target.dtype, target.dtype)}")
    shape = out_shape if reduction == 0 else ()
    return x.new_empty(shape), x.new_empty(())


def _nll_meta(x, target, weight, reduction, ignore_index):
    """The CPU's checks of nll_loss_forward, in its order, with its messages."""
    if not 0 < x.dim() <= 2:
        raise RuntimeError("input tensor should be 1D or 2D")
    if target.dim() > 1:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    if not (x.dim() == 1 and target.dim() == 0) and x.shape[0] != target.shape[0]:
        raise RuntimeError(f"size mismatch (got input: {list(x.shape)}, target: {list(target.shape)})")
    n = x.shape[-1]
    if weight is not None and not (weight.dim() == 1 and weight.numel() == n):
        raise RuntimeError(f"weight tensor should be defined either for all {n} classes or no classes "
                           f"but got weight tensor of shape: {list(weight.shape)}")
    return _nll_outputs(x, target, reduction, target.shape)


def _nll2d_meta(x, target, weight, reduction, ignore_index):
    """The CPU's checks of nll_loss2d_forward, in its order, with its messages."""
    if target.dim() != 3:
        raise RuntimeError("only batches of spatial targets supported (3D tensors) but got targets of "
                           f"dimension: {target.dim()}")
    if x.dim() != 4:
        raise RuntimeError(f"only batches of spatial inputs supported (4D tensors), but got input of dimension: {x.dim()}")
    if weight is not None and weight.numel() != x.shape[1]:
        raise RuntimeError("weight tensor should be defined either for all or no classes")
    if (x.shape[0], x.shape[2], x.shape[3]) != tuple(target.shape):
        raise RuntimeError(f"input and target batch or spatial sizes don't match: target {list(target.shape)}, "
                           f"input {list(x.shape)}")
    return _nll_outputs(x, target, reduction, target.shape)


@lowering("aten::nll_loss2d_forward", meta=_nll2d_meta, checked=True)
def nll_loss2d_forward(x, target, weight, reduction, ignore_index):
    return nll_loss_forward(x, target, weight, reduction, ignore_index)


@lowering("aten::nll_loss_forward", meta=_nll_meta, checked=True)
def nll_loss_forward(x, target, weight, reduction, ignore_index):
    check_range(target, x.shape[0 if x.ndim == 1 else 1], IndexError, "Target {value} is out of bounds.",
                nonneg=True, ignore=ignore_index)
    if jnp.issubdtype(target.dtype, jnp.floating):
        check_whole(target, ValueError, "Floating targets hold class indices: the target at flat position "
                    "{pos} is not a whole number.", ignore=ignore_index)
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


def _nll_backward_meta(g, x, target, weight, reduction, ignore_index, total_weight):
    # PyTorch's meta kernel scatters with the target, which a floating target cannot be.
    return x.new_empty(x.shape)


@lowering("aten::nll_loss_backward", "aten::nll_loss2d_backward", meta=_nll_backward_meta)
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
    keep_of_256 = (1.0 - p) * 256
    if x.dtype in (jnp.bfloat16, jnp.float16) and p > 0 and keep_of_256 == int(keep_of_256):
        # Half-precision inputs draw 8 random bits (u8) per element, as PyTorch/XLA does,
        # a quarter of the random bits and mask bytes; only where 8 bits give the keep
        # probability exactly (p = 0.5, 0.25, ...), so the mask keeps its distribution.
        keep = jax.random.bits(key, x.shape, jnp.uint8) < jnp.uint8(int(keep_of_256))
    else:
        keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    scale = 1.0 / (1.0 - p)
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype)), keep


@lowering("aten::native_dropout_backward")
def native_dropout_backward(g, mask, scale):
    return g * mask.astype(g.dtype) * jnp.asarray(scale, g.dtype)


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


# ---- margin losses' derivatives (jax's derivative of the forward) ------------------------------

def _hinge(z):
    # Zero derivative at 0, as the CPU kernels' `z > 0` test.
    return jnp.where(z > 0, z, jnp.zeros((), z.dtype))


def _meta_like_self(g, x, *args, **kwargs):
    """The derivative has the input's shape (PyTorch has no meta kernel for it)."""
    return torch.empty_like(x)


def _multi_margin(x, target, p, margin, weight, reduction):
    x2 = jnp.reshape(x, (-1, x.shape[-1]) if x.ndim else (1, 1))
    t = jnp.reshape(target, (-1,)).astype(jnp.int32)
    c = x2.shape[1]
    xy = jnp.take_along_axis(x2, t[:, None], axis=1)
    h = _hinge(margin - xy + x2)
    if p == 2:
        h = h * h
    if weight is not None:
        h = h * weight.astype(x.dtype)[t][:, None]
    h = jnp.where(jnp.arange(c)[None, :] == t[:, None], jnp.zeros((), x.dtype), h)
    loss = jnp.sum(h, axis=1) / c
    return _reduce(loss if x.ndim == 2 else jnp.reshape(loss, ()), reduction)


@lowering("aten::multi_margin_loss_backward", static=("p", "margin"), meta=_meta_like_self)
def multi_margin_loss_backward(g, x, target, p, margin, weight=None, reduction=1):
    xc = _opmath(x)
    loss, vjp = jax.vjp(lambda a: _multi_margin(a, target, p, margin, weight, reduction), xc)
    return vjp(jnp.reshape(_opmath(g).astype(xc.dtype), loss.shape))[0]


def _multilabel_margin(x, target, is_target, reduction):
    x2 = jnp.reshape(x, (-1, x.shape[-1]) if x.ndim else (1, 1))
    t = jnp.reshape(target, x2.shape)
    c = x2.shape[1]
    # The targets are the entries before the first -1.
    valid = jnp.cumprod((t >= 0).astype(jnp.int32), axis=1).astype(bool)
    xt = jnp.take_along_axis(x2, jnp.clip(t, 0, c - 1).astype(jnp.int32), axis=1)
    h = _hinge(1 - xt[:, :, None] + x2[:, None, :])
    others = jnp.reshape(is_target, x2.shape) == 0
    h = jnp.where(valid[:, :, None] & others[:, None, :], h, jnp.zeros((), x.dtype))
    loss = jnp.sum(h, axis=(1, 2)) / c
    return _reduce(loss if x.ndim == 2 else jnp.reshape(loss, ()), reduction)


def _is_target(x, target):
    """1 at the classes named before the first -1 of each target row."""
    t = jnp.reshape(target, (-1, x.shape[-1]) if x.ndim else (1, 1))
    c = t.shape[1]
    valid = jnp.cumprod((t >= 0).astype(jnp.int32), axis=1).astype(bool)
    rows = lax.broadcasted_iota(jnp.int32, t.shape, 0)
    hit = jnp.zeros(t.shape, x.dtype).at[rows, jnp.where(valid, t, c).astype(jnp.int32)].set(1, mode="drop")
    return jnp.reshape(hit, target.shape)


def _meta_multilabel_margin(x, target, reduction):
    """PyTorch's meta kernel, but a 1-D input's unreduced loss is 0-d, as on the CPU."""
    loss, is_target = torch.ops.aten.multilabel_margin_loss_forward(x, target, reduction)
    return (loss.reshape(()) if x.dim() <= 1 and reduction == 0 else loss), is_target


@lowering("aten::multilabel_margin_loss_forward", meta=_meta_multilabel_margin)
def multilabel_margin_loss_forward(x, target, reduction):
    xc = _opmath(x)
    is_target = _is_target(xc, target)
    return _multilabel_margin(xc, target, is_target, reduction), is_target


@lowering("aten::multilabel_margin_loss_backward", meta=_meta_like_self)
def multilabel_margin_loss_backward(g, x, target, reduction, is_target):
    xc = _opmath(x)
    loss, vjp = jax.vjp(lambda a: _multilabel_margin(a, target, is_target, reduction), xc)
    return vjp(jnp.reshape(_opmath(g).astype(xc.dtype), loss.shape))[0]
