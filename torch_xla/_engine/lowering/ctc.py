"""CTC loss, forward and backward."""
from __future__ import annotations


import jax.numpy as jnp
import torch
from jax import lax

from .table import lowering, out_shape
from .reductions import _calc, _out


# ---- CTC loss ------------------------------------------------------------------------------------

def _logaddexp(a, b):
    """log(exp(a) + exp(b)) whose gradient is 0, not NaN, where both are -inf."""
    m = lax.stop_gradient(jnp.maximum(a, b))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), m.dtype))
    s = jnp.exp(a - m) + jnp.exp(b - m)
    pos = s > 0
    return jnp.where(pos, m + jnp.log(jnp.where(pos, s, jnp.ones((), s.dtype))), jnp.asarray(-jnp.inf, s.dtype))


def _ctc_nll(log_probs, targets, input_lengths, target_lengths, blank, s_max):
    """(nll (N,), log_alpha (N, T, 2*s_max+1)) by the forward recursion over time in log
    space; alpha stops changing after a sample's input length."""
    lp = log_probs if log_probs.ndim == 3 else log_probs[:, None, :]
    t_len, n, _ = lp.shape
    il = jnp.reshape(jnp.asarray(input_lengths), (-1,)).astype(jnp.int64)
    tl = jnp.reshape(jnp.asarray(target_lengths), (-1,)).astype(jnp.int64)
    k = jnp.arange(s_max, dtype=jnp.int64)
    if targets.ndim == 2:
        tg = targets[:, :s_max]
    elif log_probs.ndim == 2:
        tg = targets[None, :s_max]
    else:  # concatenated targets
        off = jnp.cumsum(tl) - tl
        tg = jnp.take(targets, jnp.clip(off[:, None] + k, 0, max(targets.shape[0] - 1, 0)), mode="clip")
    tg = jnp.reshape(tg, (n, s_max)).astype(jnp.int64)
    big_l = 2 * s_max + 1
    ext = jnp.full((n, big_l), blank, jnp.int64)
    if s_max:
        ext = ext.at[:, 1::2].set(tg)
    lpe = jnp.take_along_axis(lp, jnp.broadcast_to(ext[None], (t_len, n, big_l)), axis=2)  # (T, N, L)
    s = jnp.arange(big_l)
    prev2 = jnp.concatenate([jnp.full((n, 2), -1, jnp.int64), ext[:, :-2]], axis=1)
    skip = (s >= 2) & (ext != blank) & (ext != prev2)
    valid = s[None, :] < (2 * tl + 1)[:, None]
    ninf = jnp.asarray(-jnp.inf, lp.dtype)
    a0 = jnp.where((s[None, :] == 0) | ((s[None, :] == 1) & (tl[:, None] > 0)), lpe[0], ninf)
    a0 = jnp.where(valid, a0, ninf)

    def shift(a, m):
        return jnp.concatenate([jnp.full((n, m), ninf, a.dtype), a[:, :-m]], axis=1)

    def step(a, xs):
        t, row = xs
        new = _logaddexp(_logaddexp(a, shift(a, 1)), jnp.where(skip, shift(a, 2), ninf)) + row
        new = jnp.where(valid, new, ninf)
        new = jnp.where((t < il)[:, None], new, a)
        return new, new

    last, rest = lax.scan(step, a0, (jnp.arange(1, t_len, dtype=jnp.int64), lpe[1:]))
    log_alpha = jnp.concatenate([a0[None], rest], axis=0)  # (T, N, L)
    end = jnp.take_along_axis(last, (2 * tl)[:, None], axis=1)[:, 0]
    end1 = jnp.where(tl > 0, jnp.take_along_axis(last, jnp.maximum(2 * tl - 1, 0)[:, None], axis=1)[:, 0], ninf)
    nll = -_logaddexp(end, end1)
    return nll, jnp.swapaxes(log_alpha, 0, 1)


def _ctc_meta(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """(nll (N,), log_alpha (N, T, 2 * max(target_lengths) + 1)); the width needs the
    lengths' values, so tensor lengths take the CPU."""
    if isinstance(target_lengths, torch.Tensor):
        raise NotImplementedError("ctc_loss with tensor lengths: the output width depends on their values")
    if log_probs.dim() != 3:
        raise RuntimeError(f"Expected 3-dimensional tensor, but got {log_probs.dim()}-dimensional tensor "
                           f"for argument #1 'log_probs' (while checking arguments for ctc_loss_allocate_outputs)")
    t, n = log_probs.shape[0], log_probs.shape[1]
    if len(input_lengths) != n or len(target_lengths) != n:
        raise RuntimeError("input_lengths and target_lengths must have size batch_size")
    s = max(target_lengths) if len(target_lengths) else 0
    e = lambda *sh: torch.empty(sh, dtype=log_probs.dtype, device="meta")  # noqa: E731
    return e(n), e(n, t, 2 * s + 1)


@lowering("aten::_ctc_loss", meta=_ctc_meta)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    s_max = (out_shape(1)[-1] - 1) // 2
    dt = _calc(log_probs.dtype)
    nll, la = _ctc_nll(log_probs.astype(dt), targets, input_lengths, target_lengths, blank, s_max)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), jnp.zeros((), dt), nll)
    return _out(nll, 0), _out(la, 1)


@lowering("aten::_ctc_loss_backward", meta=lambda grad, log_probs, *a, **k: torch.empty_like(log_probs))
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank,
                      zero_infinity=False):
    """PyTorch's gradient: exp(log_probs) - (posterior of each class at t), times the
    incoming gradient, zero past a sample's input length (the exp term assumes log_probs
    come from a log_softmax, whose backward then cancels it)."""
    import jax
    dt = _calc(log_probs.dtype)
    lp = log_probs.astype(dt)
    s_max = (log_alpha.shape[-1] - 1) // 2
    nll_of = lambda x: _ctc_nll(x, targets, input_lengths, target_lengths, blank, s_max)[0]  # noqa: E731
    val, vjp = jax.vjp(nll_of, lp)
    g = jnp.reshape(grad.astype(dt), (-1,))
    g = jnp.broadcast_to(g, val.shape)
    (dlp,) = vjp(jnp.ones_like(val))  # -posterior (per sample)
    batched = lp.ndim == 3
    gb = g[None, :, None] if batched else g[:, None]
    out = (jnp.exp(lp) + dlp) * gb
    il = jnp.reshape(jnp.asarray(input_lengths), (-1,)).astype(jnp.int64)
    t = jnp.arange(lp.shape[0])
    inside = (t[:, None] < il[None, :])[..., None] if batched else (t < il[0])[:, None]
    bad = jnp.isinf(val)[None, :, None] if batched else jnp.isinf(val)[:, None]
    out = jnp.where(inside, out, jnp.zeros((), dt))
    if zero_infinity:
        out = jnp.where(bad, jnp.zeros((), dt), out)
    return out
