"""Shape ops and views. Functionalization hands the backend views as functional ops
(the result is a new value, never an alias) and writes through views as `*_scatter`."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .table import lowering, out_dtype, out_shape


def _dim(d, n):
    return d + n if d < 0 else d


# The ops lowered as a row-major reshape, and as a broadcast to a shape (lowering/blas_cpu.py
# reads transposes through them).
RESHAPE_OPS = ("aten::view", "aten::view_copy", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias",
               "aten::_reshape_alias_copy", "aten::_reshape_copy")
EXPAND_OPS = ("aten::expand", "aten::expand_copy")


@lowering(*RESHAPE_OPS)
def view(x, *args):
    return jnp.reshape(x, out_shape())


_PART = {torch.complex32: np.float16, torch.complex64: np.float32, torch.complex128: np.float64}


@lowering("aten::view.dtype", "aten::view_copy.dtype")
def view_dtype(x, dtype):
    shape = tuple(out_shape())
    # Complex values are viewed through their (real, imag) parts, bool through uint8: XLA
    # bitcasts neither. complex32 is held as complex64; only its sizes fit 4-byte elements.
    if jnp.iscomplexobj(x):
        c32 = x.dtype == np.complex64 and (shape[-1] * dtype.itemsize == x.shape[-1] * 4 if x.ndim
                                          else dtype.itemsize == 4)
        part = np.float16 if c32 else np.float32 if x.dtype == np.complex64 else np.float64
        x = jnp.stack([jnp.real(x).astype(part), jnp.imag(x).astype(part)], axis=-1)
        x = jnp.reshape(x, x.shape[:-2] + (-1,)) if x.ndim > 1 else x
    elif x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if dtype.is_complex:
        part = _PART[dtype]
        y = _view_bits(x, np.dtype(part), shape[:-1] + (shape[-1] * 2,) if shape else (2,))
        y = jnp.reshape(y, shape + (2,))
        if part is np.float16:
            y = y.astype(np.float32)
        return lax.complex(y[..., 0], y[..., 1])
    if dtype == torch.bool:
        return _view_bits(x, np.dtype(np.uint8), shape) != 0
    return _view_bits(x, np.dtype(out_dtype()), shape)


def _view_bits(x, want, shape):
    """The bytes of real array `x` as elements of `want`, in `shape`."""
    if x.dtype.itemsize < want.itemsize:  # several elements make one
        k = want.itemsize // x.dtype.itemsize
        x = jnp.reshape(x, x.shape[:-1] + (x.shape[-1] // k, k))
    return jnp.reshape(lax.bitcast_convert_type(x, want), shape)


@lowering("aten::permute", "aten::permute_copy")
def permute(x, dims):
    return jnp.transpose(x, [_dim(d, x.ndim) for d in dims])


@lowering("aten::transpose.int", "aten::transpose_copy.int")
def transpose(x, d0, d1):
    if x.ndim == 0:
        return x
    return jnp.swapaxes(x, d0, d1)


@lowering("aten::t", "aten::t_copy", "aten::numpy_T", "aten::mT", "aten::matrix_H")
def t(x):
    return x.T if x.ndim == 2 else x


@lowering(*EXPAND_OPS)
def expand(x, size, implicit=False):
    return jnp.broadcast_to(x, out_shape())


@lowering("aten::squeeze", "aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze_copy",
          "aten::squeeze_copy.dim", "aten::squeeze_copy.dims")
def squeeze(x, dim=None):
    return jnp.reshape(x, out_shape())


@lowering("aten::unsqueeze", "aten::unsqueeze_copy")
def unsqueeze(x, dim):
    return jnp.reshape(x, out_shape())


@lowering("aten::select.int", "aten::select_copy.int")
def select(x, dim, index):
    dim = _dim(dim, x.ndim)
    index = index + x.shape[dim] if index < 0 else index
    return lax.index_in_dim(x, index, dim, keepdims=False)


def _slice_bounds(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


@lowering("aten::slice.Tensor", "aten::slice_copy.Tensor")
def slice_(x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    s, e, st = _slice_bounds(x.shape[dim], start, end, step)
    return lax.slice_in_dim(x, s, e, st, axis=dim)


@lowering("aten::narrow", "aten::narrow_copy")
def narrow(x, dim, start, length):
    dim = _dim(dim, x.ndim)
    if start < 0:
        start += x.shape[dim]
    return lax.slice_in_dim(x, start, start + length, 1, axis=dim)


@lowering("aten::select_scatter")
def select_scatter(x, src, dim, index):
    dim = _dim(dim, x.ndim)
    index = index + x.shape[dim] if index < 0 else index
    return lax.dynamic_update_index_in_dim(x, src.astype(x.dtype), index, dim)


@lowering("aten::slice_scatter")
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    s, e, st = _slice_bounds(x.shape[dim], start, end, step)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(s, e, st)
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@lowering("aten::diagonal", "aten::diagonal_copy")
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@lowering("aten::diagonal_scatter")
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    n = min(x.shape[d1] - max(0, -offset), x.shape[d2] - max(0, offset))
    i = np.arange(max(n, 0))
    r, c = i + max(0, -offset), i + max(0, offset)
    xm = jnp.moveaxis(x, (d1, d2), (-2, -1))
    xm = xm.at[..., r, c].set(src.astype(x.dtype))
    return jnp.moveaxis(xm, (-2, -1), (d1, d2))


def _strided_index(size, stride, offset):
    idx = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return idx


@lowering("aten::as_strided", "aten::as_strided_copy")
def as_strided(x, size, stride, storage_offset=None):
    # The base is a contiguous buffer: gather the strided elements from its flat form.
    idx = _strided_index(size, stride, storage_offset or 0)
    return jnp.reshape(x, (-1,))[idx]


@lowering("aten::as_strided_scatter")
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    idx = _strided_index(size, stride, storage_offset or 0)
    flat = jnp.reshape(x, (-1,)).at[idx.reshape(-1)].set(jnp.reshape(src, (-1,)).astype(x.dtype))
    return jnp.reshape(flat, x.shape)


@lowering("aten::cat")
def cat(tensors, dim=0):
    dt = out_dtype()
    ts = [t.astype(dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not ts:
        return jnp.zeros(out_shape(), dt)
    return jnp.concatenate(ts, axis=_dim(dim, ts[0].ndim))


@lowering("aten::stack")
def stack(tensors, dim=0):
    dt = out_dtype()
    return jnp.stack([t.astype(dt) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


@lowering("aten::split.Tensor", "aten::split_copy.Tensor")
def split(x, split_size, dim=0):
    dim = _dim(dim, x.ndim)
    n = x.shape[dim]
    outs = []
    for s in range(0, max(n, 1), max(split_size, 1)):
        outs.append(lax.slice_in_dim(x, s, min(s + split_size, n), axis=dim))
    return outs


@lowering("aten::split_with_sizes", "aten::split_with_sizes_copy")
def split_with_sizes(x, sizes, dim=0):
    dim = _dim(dim, x.ndim)
    outs, s = [], 0
    for k in sizes:
        outs.append(lax.slice_in_dim(x, s, s + k, axis=dim))
        s += k
    return outs


@lowering("aten::unbind.int", "aten::unbind_copy.int")
def unbind(x, dim=0):
    dim = _dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, dim, keepdims=False) for i in range(x.shape[dim])]


def _meta_flip(x, dims):
    # the CPU's message for a repeated dim (PyTorch's meta kernel words it otherwise)
    seen = set()
    n = max(x.dim(), 1)
    for d in dims:
        w = d + n if -n <= d < 0 else d
        if not 0 <= w < n:
            break           # PyTorch's kernel raises the CPU's IndexError for it
        if w in seen:
            raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
        seen.add(w)
    return torch.ops.aten.flip.default(x, dims)


@lowering("aten::flip", meta=_meta_flip)
def flip(x, dims):
    return jnp.flip(x, [_dim(d, x.ndim) for d in dims]) if dims and x.ndim else x   # 0-d: itself


@lowering("aten::roll")
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.reshape(jnp.roll(jnp.reshape(x, (-1,)), shifts[0]), x.shape)
    return jnp.roll(x, tuple(shifts), tuple(_dim(d, x.ndim) for d in dims))


@lowering("aten::repeat")
def repeat(x, repeats):
    nd = len(repeats)
    x = jnp.reshape(x, (1,) * (nd - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@lowering("aten::unfold", "aten::unfold_copy")
def unfold(x, dim, size, step):
    if x.ndim == 0:
        return jnp.reshape(x, (1,))
    dim = _dim(dim, x.ndim)
    n = (x.shape[dim] - size) // step + 1
    idx = (np.arange(n)[:, None] * step + np.arange(size)[None, :])
    y = jnp.take(x, idx.reshape(-1), axis=dim)
    y = jnp.reshape(y, x.shape[:dim] + (n, size) + x.shape[dim + 1:])
    return jnp.moveaxis(y, dim + 1, -1)


@lowering("aten::tril")
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowering("aten::triu")
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowering("aten::constant_pad_nd")
def constant_pad_nd(x, pad, value=0):
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        cfg[d] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), cfg)


# ---- backward of views: scatter the gradient into zeros --------------------------------------
# (PyTorch's generic kernels write through a view of a fresh zeros tensor, which only works
# for tensors that share storage; these are the functional forms.)

@lowering("aten::select_backward")
def select_backward(grad, input_sizes, dim, index):
    z = jnp.zeros(tuple(input_sizes), grad.dtype)
    return select_scatter(z, grad, dim, index)


@lowering("aten::slice_backward")
def slice_backward(grad, input_sizes, dim, start, end, step):
    z = jnp.zeros(tuple(input_sizes), grad.dtype)
    return slice_scatter(z, grad, dim, start, end, step)


@lowering("aten::diagonal_backward")
def diagonal_backward(grad, input_sizes, offset, dim1, dim2):
    z = jnp.zeros(tuple(input_sizes), grad.dtype)
    return diagonal_scatter(z, grad, offset, dim1, dim2)


@lowering("aten::unfold_backward")
def unfold_backward(grad, input_sizes, dim, size, step):
    nd = len(input_sizes)
    dim = _dim(dim, nd) if nd else 0
    if nd == 0:
        return jnp.reshape(grad, ())
    n = grad.shape[dim]
    idx = (np.arange(n)[:, None] * step + np.arange(size)[None, :])  # (n, size)
    g = jnp.moveaxis(grad, -1, dim + 1)  # (..., n, size, ...)
    g = jnp.reshape(g, g.shape[:dim] + (n * size,) + g.shape[dim + 2:])
    z = jnp.zeros(tuple(input_sizes), grad.dtype)
    sl = [slice(None)] * nd
    sl[dim] = idx.reshape(-1)
    return z.at[tuple(sl)].add(g)


@lowering("aten::block_diag")
def block_diag(tensors):
    dt = out_dtype()
    mats = [jnp.reshape(t, (1, -1)) if t.ndim < 2 else t for t in tensors]
    mats = [jnp.reshape(t, (1, 1)) if t.ndim == 0 else t for t in mats]
    rows, cols = out_shape()
    out = jnp.zeros((rows, cols), dt)
    r = c = 0
    for m in mats:
        out = lax.dynamic_update_slice(out, m.astype(dt), (r, c))
        r += m.shape[0]
        c += m.shape[1]
    return out
