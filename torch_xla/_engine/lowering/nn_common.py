"""Helpers shared by the neural-network lowering families (nn_ops, conv, pooling)."""
from __future__ import annotations

import jax.numpy as jnp
import torch

from .table import ctx


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
