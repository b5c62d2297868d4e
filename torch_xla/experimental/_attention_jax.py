"""Attention kernels written in jax: blockwise (flash) attention and paged attention.

Every function here is a function of jax arrays, applied to xla tensors by
`torch_xla.experimental.custom_kernel` through `call_jax`. None materialises a
sequence x sequence matrix: scores exist one (query block, key block) tile at a time,
softmax is accumulated online (running maximum and sum), and the backward recomputes the
tiles from the inputs, the output and the log-sum-exp of each row.

jax is imported inside the functions: importing this module must not start jax (jax
starts through `pjrt.jax_module()`, after the process's patches).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import numpy as np

# A large finite negative score for masked positions: exp() of it is 0 against any real
# score, and a row with every position masked averages its values instead of giving NaN
# (what the Pallas kernels do).
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class FlashConfig(NamedTuple):
    """Static settings of one blockwise attention (hashable: part of the trace key)."""
    causal: bool
    sm_scale: float
    block_q: int
    block_k: int
    precision: Optional[str]


def _blocks(n: int, block: int) -> Tuple[int, int]:
    """(block size, number of blocks) covering n positions."""
    b = max(1, min(block, n))
    return b, -(-n // b)


def _pad_to(x, axis: int, size: int, value=0):
    import jax.numpy as jnp
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _tile(x, axis: int, start, size: int):
    from jax import lax
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _ab_tile(ab, i0, j0, bq: int, bk: int):
    from jax import lax
    return lax.dynamic_slice(ab, (0, 0, i0, j0), (ab.shape[0], ab.shape[1], bq, bk))


def _keep(i0, j0, bq: int, bk: int, kv_len: int, causal: bool, qs, ks):
    """Which (query, key) pairs of the tile at (i0, j0) take part: a [B|1, 1, bq, bk] mask."""
    import jax.numpy as jnp
    from jax import lax
    rows = i0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = j0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    keep = cols < kv_len   # padding keys
    if causal:
        keep = keep & (cols <= rows)
    keep = keep[None, None]
    if qs is not None:
        q_ids = _tile(qs, 1, i0, bq)[:, None, :, None]
        kv_ids = _tile(ks, 1, j0, bk)[:, None, None, :]
        keep = keep & (q_ids == kv_ids)
    return keep


def _scores(qi, kj, ab, qs, ks, i0, j0, bq, bk, kv_len, cfg: FlashConfig):
    import jax.numpy as jnp
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj, preferred_element_type=jnp.float32,
                   precision=cfg.precision) * cfg.sm_scale
    if ab is not None:
        s = s + _ab_tile(ab, i0, j0, bq, bk).astype(jnp.float32)
    keep = _keep(i0, j0, bq, bk, kv_len, cfg.causal, qs, ks)
    return jnp.where(keep, s, DEFAULT_MASK_VALUE)


def _k_blocks_for(i, bq: int, bk: int, nk: int, causal: bool):
    """How many key blocks query block i reads (causal: up to its last row's diagonal)."""
    import jax.numpy as jnp
    if not causal:
        return nk
    return jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk)


def flash_forward(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg: FlashConfig):
    """Blockwise attention of q [B, H, Lq, D] over k, v [B, H, Lk, D]: (output, lse), lse
    the float32 log-sum-exp of each query's scores [B, H, Lq]."""
    import jax.numpy as jnp
    from jax import lax
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bq, nq = _blocks(Lq, cfg.block_q)
    bk, nk = _blocks(Lk, cfg.block_k)
    q = _pad_to(q, 2, nq * bq)
    k, v = _pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk)
    ab = _pad_to(_pad_to(ab, 2, nq * bq), 3, nk * bk)
    qs = _pad_to(q_segment_ids, 1, nq * bq)
    ks = _pad_to(kv_segment_ids, 1, nk * bk)
    mm_dtype = v.dtype

    def q_block(i, bufs):
        out, lse = bufs
        i0 = i * bq
        qi = _tile(q, 2, i0, bq)

        def k_block(j, state):
            m, l, acc = state
            j0 = j * bk
            s = _scores(qi, _tile(k, 2, j0, bk), ab, qs, ks, i0, j0, bq, bk, Lk, cfg)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(mm_dtype), _tile(v, 2, j0, bk),
                            preferred_element_type=jnp.float32, precision=cfg.precision)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

        init = (jnp.full((B, H, bq), -jnp.inf, jnp.float32), jnp.zeros((B, H, bq), jnp.float32),
                jnp.zeros((B, H, bq, D), jnp.float32))
        m, l, acc = lax.fori_loop(0, _k_blocks_for(i, bq, bk, nk, cfg.causal), k_block, init)
        out = lax.dynamic_update_slice_in_dim(out, (acc / l[..., None]).astype(out.dtype), i0, axis=2)
        lse = lax.dynamic_update_slice_in_dim(lse, m + jnp.log(l), i0, axis=2)
        return out, lse

    bufs = (jnp.zeros((B, H, nq * bq, D), q.dtype), jnp.zeros((B, H, nq * bq), jnp.float32))
    out, lse = lax.fori_loop(0, nq, q_block, bufs)
    return out[:, :, :Lq], lse[:, :, :Lq]


def flash_backward(q, k, v, ab, q_segment_ids, kv_segment_ids, out, lse, d_out, cfg: FlashConfig):
    """Gradients (dq, dk, dv, dab or None) of `flash_forward`'s output, the score tiles
    recomputed from the inputs and the saved log-sum-exp."""
    import jax.numpy as jnp
    from jax import lax
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    bq, nq = _blocks(Lq, cfg.block_q)
    bk, nk = _blocks(Lk, cfg.block_k)
    dtypes = (q.dtype, k.dtype, v.dtype, None if ab is None else ab.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
    q, d_out = _pad_to(q, 2, nq * bq), _pad_to(d_out, 2, nq * bq)
    delta, lse = _pad_to(delta, 2, nq * bq), _pad_to(lse, 2, nq * bq)
    k, v = _pad_to(k, 2, nk * bk), _pad_to(v, 2, nk * bk)
    ab = _pad_to(_pad_to(ab, 2, nq * bq), 3, nk * bk)
    qs = _pad_to(q_segment_ids, 1, nq * bq)
    ks = _pad_to(kv_segment_ids, 1, nk * bk)
    f32, prec = jnp.float32, cfg.precision

    def k_block(j, bufs):
        dq, dk, dv, dab = bufs
        j0 = j * bk
        kj, vj = _tile(k, 2, j0, bk), _tile(v, 2, j0, bk)

        def q_block(i, state):
            dkj, dvj, dq, dab = state
            i0 = i * bq
            qi, doi = _tile(q, 2, i0, bq), _tile(d_out, 2, i0, bq)
            s = _scores(qi, kj, ab, qs, ks, i0, j0, bq, bk, Lk, cfg)
            p = jnp.exp(s - _tile(lse, 2, i0, bq)[..., None])
            dvj = dvj + jnp.einsum("bhqk,bhqd->bhkd", p.astype(doi.dtype), doi, preferred_element_type=f32,
                                   precision=prec)
            dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vj, preferred_element_type=f32, precision=prec)
            ds = p * (dp - _tile(delta, 2, i0, bq)[..., None])
            if dab is not None:
                dab = lax.dynamic_update_slice(dab, ds.astype(dab.dtype), (0, 0, i0, j0))
            ds_scaled = (ds * cfg.sm_scale).astype(qi.dtype)
            dqi = _tile(dq, 2, i0, bq) + jnp.einsum("bhqk,bhkd->bhqd", ds_scaled, kj, preferred_element_type=f32,
                                                     precision=prec)
            dq = lax.dynamic_update_slice_in_dim(dq, dqi, i0, axis=2)
            dkj = dkj + jnp.einsum("bhqk,bhqd->bhkd", ds_scaled, qi, preferred_element_type=f32, precision=prec)
            return dkj, dvj, dq, dab

        first = (j0 // bq) if cfg.causal else 0   # causal: earlier query blocks see none of these keys
        zeros = jnp.zeros((B, H, bk, D), f32)
        dkj, dvj, dq, dab = lax.fori_loop(first, nq, q_block, (zeros, zeros, dq, dab))
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j0, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j0, axis=2)
        return dq, dk, dv, dab

    bufs = (jnp.zeros((B, H, nq * bq, D), f32), jnp.zeros((B, H, nk * bk, D), f32),
            jnp.zeros((B, H, nk * bk, D), f32), None if ab is None else jnp.zeros(ab.shape, f32))
    dq, dk, dv, dab = lax.fori_loop(0, nk, k_block, bufs)
    grads = (dq[:, :, :Lq], dk[:, :, :Lk], dv[:, :, :Lk], None if dab is None else dab[:, :, :Lq, :Lk])
    return tuple(None if g is None else g.astype(d) for g, d in zip(grads, dtypes))


@functools.lru_cache(maxsize=None)
def _custom_vjp_flash():
    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
    def flash(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg):
        return flash_forward(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg)[0]

    def fwd(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg):
        out, lse = flash_forward(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg)
        return out, (q, k, v, ab, q_segment_ids, kv_segment_ids, out, lse)

    def bwd(cfg, res, d_out):
        q, k, v, ab, qs, ks, out, lse = res
        dq, dk, dv, dab = flash_backward(q, k, v, ab, qs, ks, out, lse, d_out, cfg)
        return dq, dk, dv, dab, None, None

    flash.defvjp(fwd, bwd)
    return flash


def flash_attention(q, k, v, ab=None, q_segment_ids=None, kv_segment_ids=None, *, causal: bool = False,
                    sm_scale: float = 1.0, block_q: int = 512, block_k: int = 512,
                    precision: Optional[str] = None):
    """Blockwise attention as a differentiable jax function (`jax.custom_vjp`: the
    backward saves the output and the log-sum-exp and recomputes the score tiles)."""
    cfg = FlashConfig(bool(causal), float(sm_scale), int(block_q), int(block_k), precision)
    return _custom_vjp_flash()(q, k, v, ab, q_segment_ids, kv_segment_ids, cfg)


# ---------------------------------------------------------------------------------------
# Pallas kernels where jax ships one for the backend

def tpu_flash_block(n: int) -> Optional[int]:
    """A block size the TPU Pallas kernel accepts for a sequence of n (a multiple of 128
    dividing n), or None."""
    for b in (512, 256, 128):
        if n % b == 0:
            return b
    return None


def pallas_tpu_flash(q, k, v, ab, q_segment_ids, kv_segment_ids, *, causal: bool, sm_scale: float):
    """jax's TPU Pallas flash attention (differentiable through its own custom_vjp)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    Lq, Lk = q.shape[2], k.shape[2]
    bq, bk = tpu_flash_block(Lq), tpu_flash_block(Lk)
    blocks = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                           block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
                           block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)
    seg = None if q_segment_ids is None else fa.SegmentIds(q_segment_ids, kv_segment_ids)
    return fa.flash_attention(q, k, v, ab, seg, causal=causal, sm_scale=sm_scale, block_sizes=blocks)


def pallas_gpu_flash(q, k, v, segment_ids, *, causal: bool, sm_scale: float):
    """jax's GPU (Triton) Pallas attention; it takes [B, L, H, D] and one set of segment ids."""
    from jax.experimental.pallas.ops.gpu import attention as fa
    t = (0, 2, 1, 3)
    out = fa.mha(q.transpose(t), k.transpose(t), v.transpose(t), segment_ids, sm_scale=sm_scale, causal=causal)
    return out.transpose(t)


# ---------------------------------------------------------------------------------------
# paged attention

def _softmax_step(s, v, state, precision, einsum_pv: str):
    """One online-softmax step: scores s [..., n] over values v; state (m, l, acc)."""
    import jax.numpy as jnp
    m, l, acc = state
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum(einsum_pv, p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv


def paged_attention(q, k_pages, v_pages, lengths, page_indices, *, pages_per_compute_block: int,
                    attn_logits_soft_cap: Optional[float] = None, mask_value: float = DEFAULT_MASK_VALUE,
                    precision: Optional[str] = None):
    """Decode attention over paged keys/values: q [B, Hq, D]; k_pages, v_pages [Hkv, P,
    page_size, D]; lengths i32[B]; page_indices i32[B, pages_per_sequence]. Query head h
    reads key/value head h // (Hq // Hkv); positions at or past a sequence's length are
    masked. The pages of `pages_per_compute_block` at a time are gathered per sequence."""
    import jax.numpy as jnp
    from jax import lax
    B, Hq, D = q.shape
    Hkv, _, page_size, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    g = Hq // Hkv
    ppb = pages_per_compute_block
    n_blocks = -(-pages_per_seq // ppb)
    page_indices = _pad_to(page_indices, 1, n_blocks * ppb)
    qg = q.reshape(B, Hkv, g, D)
    lengths = lengths.astype(jnp.int32)

    def block(c, state):
        idx = lax.dynamic_slice_in_dim(page_indices, c * ppb, ppb, axis=1)       # [B, ppb]
        kb = k_pages[:, idx].reshape(Hkv, B, ppb * page_size, D)
        vb = v_pages[:, idx].reshape(Hkv, B, ppb * page_size, D)
        s = jnp.einsum("bhgd,hbkd->bhgk", qg, kb, preferred_element_type=jnp.float32, precision=precision)
        if attn_logits_soft_cap is not None:
            s = jnp.tanh(s / attn_logits_soft_cap) * attn_logits_soft_cap
        pos = c * ppb * page_size + jnp.arange(ppb * page_size, dtype=jnp.int32)
        s = s + jnp.where(pos[None, :] < lengths[:, None], 0.0, mask_value)[:, None, None, :]
        return _softmax_step(s, vb, state, precision, "bhgk,hbkd->bhgd")

    init = (jnp.full((B, Hkv, g), -jnp.inf, jnp.float32), jnp.zeros((B, Hkv, g), jnp.float32),
            jnp.zeros((B, Hkv, g, D), jnp.float32))
    needed = jnp.minimum(n_blocks, (jnp.max(lengths) + ppb * page_size - 1) // (ppb * page_size))
    m, l, acc = lax.fori_loop(0, jnp.maximum(needed, 1), block, init)
    return (acc / l[..., None]).reshape(B, Hq, D).astype(q.dtype)


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float = 1.0,
                           sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                           mask_value: float = DEFAULT_MASK_VALUE, k_scale: Optional[float] = None,
                           v_scale: Optional[float] = None, pages_per_block: int = 16,
                           precision: Optional[str] = None):
    """Attention of ragged sequences over paged keys/values (mixed prefill and decode).

    q [T, Hq, D] holds the new tokens of sequence i at rows cu_q_lens[i]:cu_q_lens[i + 1]
    (i < num_seqs[0]), the last tokens of its kv_lens[i] keys: token t of a sequence of
    q_len new tokens sits at position kv_len - q_len + t and reads keys at positions <= its
    own (and > its own - sliding_window). kv_pages [P, page_size, 2 * Hkv, D] interleaves
    keys (even heads) and values (odd heads). Rows past cu_q_lens[num_seqs] are zero.
    Each token gathers its sequence's pages `pages_per_block` at a time."""
    import jax.numpy as jnp
    from jax import lax
    T, Hq, D = q.shape
    _, page_size, hc, _ = kv_pages.shape
    Hkv = hc // 2
    g = Hq // Hkv
    max_seqs, pages_per_seq = page_indices.shape
    ppb = max(1, min(pages_per_block, pages_per_seq))
    n_blocks = -(-pages_per_seq // ppb)
    page_indices = _pad_to(page_indices, 1, n_blocks * ppb)
    n = num_seqs.reshape(-1)[0].astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    tok = jnp.arange(T, dtype=jnp.int32)
    # the sequence of each token: the last i with cu[i] <= t, among the first num_seqs
    starts = jnp.where(jnp.arange(max_seqs) < n, cu[:max_seqs], jnp.iinfo(jnp.int32).max)
    seq = jnp.clip(jnp.searchsorted(starts, tok, side="right") - 1, 0, max_seqs - 1)
    valid = tok < cu[n]
    q_len = cu[seq + 1] - cu[seq]
    tok_kv_len = jnp.where(valid, kv_lens[seq], 0)
    pos = tok_kv_len - q_len + (tok - cu[seq])                                  # [T]
    qg = q.reshape(T, Hkv, g, D)

    def scaled(x, scale):
        if scale is None:
            return x
        return (x.astype(jnp.float32) * scale).astype(q.dtype)

    def block(c, state):
        idx = lax.dynamic_slice_in_dim(page_indices, c * ppb, ppb, axis=1)[seq]   # [T, ppb]
        kv = kv_pages[idx].reshape(T, ppb * page_size, hc, D)
        kb, vb = scaled(kv[:, :, 0::2], k_scale), scaled(kv[:, :, 1::2], v_scale)
        s = jnp.einsum("thgd,tkhd->thgk", qg, kb, preferred_element_type=jnp.float32, precision=precision)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        col = c * ppb * page_size + jnp.arange(ppb * page_size, dtype=jnp.int32)
        keep = (col[None, :] <= pos[:, None]) & (col[None, :] < tok_kv_len[:, None])
        if sliding_window is not None:
            keep = keep & (col[None, :] > pos[:, None] - sliding_window)
        s = s + jnp.where(keep, 0.0, mask_value)[:, None, None, :]
        return _softmax_step(s, vb, state, precision, "thgk,tkhd->thgd")

    init = (jnp.full((T, Hkv, g), -jnp.inf, jnp.float32), jnp.zeros((T, Hkv, g), jnp.float32),
            jnp.zeros((T, Hkv, g, D), jnp.float32))
    span = ppb * page_size
    needed = jnp.minimum(n_blocks, (jnp.max(tok_kv_len) + span - 1) // span)
    m, l, acc = lax.fori_loop(0, jnp.maximum(needed, 1), block, init)
    out = (acc / l[..., None]).reshape(T, Hq, D)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)

