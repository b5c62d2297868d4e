"""Recurrent layers as one loop in the program (`lax.scan`), not one step per time step.

`xla::gru_layer` is one GRU layer over a whole sequence (PyTorch's gate order r, z, n);
`xla::gru_layer_backward` its vector-Jacobian product, which runs the loop again
(forward values are recomputed rather than kept per step). PyTorch's own GRU / LSTM code
runs the fused cells, lowered here too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from .table import lowering, matmul_precision


def _gru(x, h0, w_ih, w_hh, b_ih, b_hh):
    import jax
    import jax.numpy as jnp
    from jax import lax
    gi = jnp.einsum("tbi,gi->tbg", x, w_ih, precision=matmul_precision())
    if b_ih is not None:
        gi = gi + b_ih
    hidden = h0.shape[-1]

    def step(h, g):
        gh = jnp.dot(h, w_hh.T, precision=matmul_precision())
        if b_hh is not None:
            gh = gh + b_hh
        r = jax.nn.sigmoid(g[:, :hidden] + gh[:, :hidden])
        z = jax.nn.sigmoid(g[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
        n = jnp.tanh(g[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
        h = (1 - z) * n + z * h
        return h, h

    h_last, out = lax.scan(step, h0, gi)
    return out, h_last


def _split(args, has_bias):
    if has_bias:
        return args[:6], args[6:]
    return args[:4] + (None, None), args[4:]


@lowering("xla::gru_layer")
def gru_layer(*args):
    """args: x (T, B, I), h0 (B, H), w_ih (3H, I), w_hh (3H, H)[, b_ih, b_hh], has_bias.
    Returns the outputs (T, B, H) and the last hidden state (B, H)."""
    (x, h0, w_ih, w_hh, b_ih, b_hh), _ = _split(args[:-1], args[-1])
    return _gru(x, h0, w_ih, w_hh, b_ih, b_hh)


@lowering("xla::gru_layer_backward")
def gru_layer_backward(*args):
    """args: the forward's inputs, then the gradients of its two outputs, has_bias.
    Returns the gradients of x, h0, w_ih, w_hh[, b_ih, b_hh]."""
    import jax
    has_bias = args[-1]
    primals, (g_out, g_h) = _split(args[:-1], has_bias)
    if has_bias:
        _, vjp = jax.vjp(_gru, *primals)
    else:
        _, vjp = jax.vjp(lambda x, h0, w_ih, w_hh: _gru(x, h0, w_ih, w_hh, None, None), *primals[:4])
    return tuple(vjp((g_out, g_h)))


# ---- fused recurrent cells -----------------------------------------------------------------
# PyTorch's RNN modules call the fused cells on every device but the CPU; the CPU has no
# kernel for them, so they are lowered here. The workspace keeps what the backward reads,
# in PyTorch's layout: GRU (r, z, n, hx, hn) and LSTM (i, f, g, o), each a block of H columns.

def _meta_gru_cell(ig, hg, hx, ib=None, hb=None):
    b, h = hx.shape
    return torch.empty_like(hx), torch.empty((b, 5 * h), dtype=hx.dtype, device="meta")


@lowering("aten::_thnn_fused_gru_cell", meta=_meta_gru_cell, promote=True)
def thnn_fused_gru_cell(ig, hg, hx, ib=None, hb=None):
    if ib is not None:
        ig = ig + ib
    if hb is not None:
        hg = hg + hb
    ri, zi, ni = jnp.split(ig, 3, axis=1)
    rh, zh, nh = jnp.split(hg, 3, axis=1)
    r = jax.nn.sigmoid(ri + rh)
    z = jax.nn.sigmoid(zi + zh)
    n = jnp.tanh(ni + r * nh)
    hy = n + z * (hx - n)
    return hy, jnp.concatenate([r, z, n, hx, nh], axis=1)


def _meta_gru_cell_backward(g, ws, has_bias):
    b, h = g.shape
    gates = torch.empty((b, 3 * h), dtype=g.dtype, device="meta")
    bias = torch.empty((3 * h if has_bias else 0,), dtype=g.dtype, device="meta")
    return gates, gates.clone(), torch.empty_like(g), bias, bias.clone()


@lowering("aten::_thnn_fused_gru_cell_backward", meta=_meta_gru_cell_backward, promote=True)
def thnn_fused_gru_cell_backward(g, ws, has_bias):
    r, z, n, hx, nh = jnp.split(ws, 5, axis=1)
    dz = g * (hx - n) * z * (1 - z)
    dn = g * (1 - z) * (1 - n * n)
    dr = dn * nh * r * (1 - r)
    d_ig = jnp.concatenate([dr, dz, dn], axis=1)
    d_hg = jnp.concatenate([dr, dz, dn * r], axis=1)
    if has_bias:
        d_ib, d_hb = d_ig.sum(0), d_hg.sum(0)
    else:
        d_ib = d_hb = jnp.zeros((0,), g.dtype)
    return d_ig, d_hg, g * z, d_ib, d_hb


def _meta_lstm_cell(ig, hg, cx, ib=None, hb=None):
    b, h = cx.shape
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty((b, 4 * h), dtype=cx.dtype, device="meta")


@lowering("aten::_thnn_fused_lstm_cell", meta=_meta_lstm_cell, promote=True)
def thnn_fused_lstm_cell(ig, hg, cx, ib=None, hb=None):
    gates = ig + hg
    if ib is not None:
        gates = gates + ib
    if hb is not None:
        gates = gates + hb
    i, f, g, o = jnp.split(gates, 4, axis=1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * cx + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=1)


def _meta_lstm_cell_backward(ghy, gcy, cx, cy, ws, has_bias):
    b, h = cx.shape
    return (torch.empty((b, 4 * h), dtype=cx.dtype, device="meta"), torch.empty_like(cx),
            torch.empty((4 * h if has_bias else 0,), dtype=cx.dtype, device="meta"))


@lowering("aten::_thnn_fused_lstm_cell_backward_impl", meta=_meta_lstm_cell_backward, promote=True)
def thnn_fused_lstm_cell_backward_impl(ghy, gcy, cx, cy, ws, has_bias):
    i, f, g, o = jnp.split(ws, 4, axis=1)
    tcy = jnp.tanh(cy)
    dcy = jnp.zeros_like(cy) if gcy is None else gcy
    do = jnp.zeros_like(cy)
    if ghy is not None:   # an undefined gradient is zero
        do = ghy * tcy
        dcy = dcy + ghy * o * (1 - tcy * tcy)
    d_gates = jnp.concatenate([dcy * g * i * (1 - i), dcy * cx * f * (1 - f), dcy * i * (1 - g * g),
                               do * o * (1 - o)], axis=1)
    d_bias = d_gates.sum(0) if has_bias else jnp.zeros((0,), d_gates.dtype)
    return d_gates, dcy * f, d_bias
