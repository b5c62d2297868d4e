"""Recurrent layers as one loop in the program (`lax.scan`), not one step per time step.

`xla::gru_layer` is one GRU layer over a whole sequence (PyTorch's gate order r, z, n);
`xla::gru_layer_backward` its vector-Jacobian product, which runs the loop again
(forward values are recomputed rather than kept per step).
"""
from __future__ import annotations

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
