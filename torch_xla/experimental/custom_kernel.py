"""`torch_xla.experimental.custom_kernel`: attention kernels and kernel helpers.

`flash_attention`, `paged_attention` and `ragged_paged_attention` are jax functions
applied to xla tensors as nodes of the lazy graph (`call_jax`), so they run on every
backend. Where jax ships a Pallas kernel for the running platform it is used (TPU: flash,
paged and ragged paged attention; GPU: flash attention without a bias); everywhere else
the blockwise jax implementation of `_attention_jax` runs, which never holds a sequence x
sequence matrix. Importing this module defines `torch.ops.xla.flash_attention`,
`torch.ops.xla.paged_attention` and `torch.ops.xla.ragged_paged_attention`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional, Sequence

import torch

from .._engine import pjrt
from .._engine.kernels import library as _library
from .._engine.lowering import table as _table
from ..core import _jax_call
from . import _attention_jax as _aj

__all__ = ["flash_attention", "paged_attention", "ragged_paged_attention", "repeat_with_fixed_output_size",
           "DEFAULT_MASK_VALUE"]

DEFAULT_MASK_VALUE = _aj.DEFAULT_MASK_VALUE

# Tile sizes of the blockwise path: 512 x 512 float32 score tiles (1 MB per head) keep
# the working set small at any sequence length while the products stay large enough to
# run near the matrix unit's speed.
BLOCK_Q = 512
BLOCK_K = 512


# ---------------------------------------------------------------------------------------
# flash attention

def _check_flash(q, k, v, q_segment_ids, kv_segment_ids, ab) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"flash_attention: {name} must be [..., num_heads, seq_len, head_dim], "
                             f"got shape {list(t.shape)}")
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"flash_attention: q, k and v must have the same rank, got {list(q.shape)}, "
                         f"{list(k.shape)} and {list(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"flash_attention: batch / head dimensions differ: q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"flash_attention: k and v sequence lengths differ: {k.shape[-2]} and {v.shape[-2]}")
    if q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1]:
        raise ValueError(f"flash_attention: head dimensions differ: q {q.shape[-1]}, k {k.shape[-1]}, "
                         f"v {v.shape[-1]}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: give both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        want_q, want_kv = (*q.shape[:-3], q.shape[-2]), (*k.shape[:-3], k.shape[-2])
        if tuple(q_segment_ids.shape) != want_q:
            raise ValueError(f"flash_attention: q_segment_ids must have shape {list(want_q)}, "
                             f"got {list(q_segment_ids.shape)}")
        if tuple(kv_segment_ids.shape) != want_kv:
            raise ValueError(f"flash_attention: kv_segment_ids must have shape {list(want_kv)}, "
                             f"got {list(kv_segment_ids.shape)}")
        for name, s in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool:
                raise ValueError(f"flash_attention: {name} must be an integer tensor, got {s.dtype}")
    if ab is not None:
        want = (*q.shape[:-1], k.shape[-2])
        if tuple(ab.shape) != want:
            raise ValueError(f"flash_attention: ab must have shape {list(want)}, got {list(ab.shape)}")


def _impl(q, k, ab, q_segment_ids, kv_segment_ids) -> str:
    """Which kernel runs: a Pallas one where jax has one that takes these inputs."""
    platform = pjrt.platform()
    lq, lk = q.shape[-2], k.shape[-2]
    if platform == "TPU" and _aj.tpu_flash_block(lq) and _aj.tpu_flash_block(lk):
        return "tpu"
    if (platform == "CUDA" and ab is None and lq == lk and lq % 128 == 0
            and (q_segment_ids is None or q_segment_ids is kv_segment_ids)):
        return "gpu"
    return "blockwise"


def _fwd_jax(q, k, v, ab, qs, ks, *, impl: str, cfg: _aj.FlashConfig):
    if impl == "blockwise":
        return _aj.flash_forward(q, k, v, ab, qs, ks, cfg)
    return _pallas(q, k, v, ab, qs, ks, impl, cfg), None


def _pallas(q, k, v, ab, qs, ks, impl: str, cfg: _aj.FlashConfig):
    if impl == "tpu":
        return _aj.pallas_tpu_flash(q, k, v, ab, qs, ks, causal=cfg.causal, sm_scale=cfg.sm_scale)
    return _aj.pallas_gpu_flash(q, k, v, qs, causal=cfg.causal, sm_scale=cfg.sm_scale)


def _bwd_jax(q, k, v, ab, qs, ks, out, lse, d_out, *, impl: str, cfg: _aj.FlashConfig):
    if impl == "blockwise":
        return _aj.flash_backward(q, k, v, ab, qs, ks, out, lse, d_out, cfg)
    import jax
    # The Pallas kernels keep their residuals inside their own custom_vjp: run it again.
    if ab is None:
        _, vjp = jax.vjp(lambda q, k, v: _pallas(q, k, v, None, qs, ks, impl, cfg), q, k, v)
        return (*vjp(d_out), None)
    _, vjp = jax.vjp(lambda q, k, v, ab: _pallas(q, k, v, ab, qs, ks, impl, cfg), q, k, v, ab)
    return vjp(d_out)


class _Sharded:
    """The manual-sharding region of one call under SPMD: inputs enter split by the
    partition spec (batch and head dimensions), outputs leave as global tensors."""

    def __init__(self, partition_spec, mesh):
        import torch_xla.distributed.spmd as xs
        self.xs = xs
        self.spec = tuple(partition_spec)
        self.mesh = mesh or xs.get_global_mesh()
        if self.mesh is None:
            raise ValueError("flash_attention: partition_spec needs a mesh (the mesh= argument or "
                             "xs.set_global_mesh)")
        if len(self.spec) != 4:
            raise ValueError(f"flash_attention: partition_spec must have 4 entries (batch, heads, sequence, "
                             f"head_dim), got {self.spec}")
        if self.spec[2] is not None or self.spec[3] is not None:
            # each device attends over its own keys only: a split sequence would be wrong
            raise ValueError(f"flash_attention: partition_spec may split the batch and head dimensions only, "
                             f"got {self.spec}")
        # per tensor kind: [B, H, L, D], the row statistics [B, H, L], segment ids [B, L]
        self.specs = {"x": self.spec, "row": self.spec[:3], "seg": (self.spec[0], self.spec[2])}

    def enter(self, t, kind: str):
        if t is None:
            return None
        return self.xs.enable_manual_sharding(t, self.specs[kind], mesh=self.mesh).global_tensor

    def leave(self, t, kind: str, full_shape):
        if t is None:
            return None
        spec = self.specs[kind]
        return self.xs.disable_manual_sharding(t, spec, tuple(full_shape), mesh=self.mesh).global_tensor


def _run(fn, tensors: dict, kinds: dict, statics: dict, sharded: Optional[_Sharded], out_kinds, out_shapes):
    """`fn(**tensors, **statics)` through `call_jax`, inside a manual region when sharded."""
    if sharded is not None:
        tensors = {n: sharded.enter(t, kinds[n]) for n, t in tensors.items()}
    outs = _jax_call.call_jax(fn, (), {**tensors, **statics}, name=fn.__name__.strip("_"))
    if sharded is not None:
        outs = tuple(sharded.leave(o, k, s) for o, k, s in zip(outs, out_kinds, out_shapes))
    return outs


_IN_KINDS = {"q": "x", "k": "x", "v": "x", "ab": "x", "qs": "seg", "ks": "seg", "out": "x", "lse": "row",
             "d_out": "x"}


class _FlashAttention(torch.autograd.Function):
    """Forward: one node computing (output, log-sum-exp); backward: one node recomputing
    the score tiles from them."""

    @staticmethod
    def forward(ctx, q, k, v, ab, qs, ks, impl, cfg, sharded):
        ins = {"q": q, "k": k, "v": v, "ab": ab, "qs": qs, "ks": ks}
        full_lse = tuple(q.shape[:3])
        out, lse = _run(_fwd_jax, ins, _IN_KINDS, {"impl": impl, "cfg": cfg}, sharded, ("x", "row"),
                        (q.shape, full_lse))
        ctx.impl, ctx.cfg, ctx.sharded = impl, cfg, sharded
        ctx.save_for_backward(q, k, v, ab, qs, ks, out, lse)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, ab, qs, ks, out, lse = ctx.saved_tensors
        ins = {"q": q, "k": k, "v": v, "ab": ab, "qs": qs, "ks": ks, "out": out, "lse": lse,
               "d_out": d_out.contiguous()}
        shapes = (q.shape, k.shape, v.shape, None if ab is None else ab.shape)
        grads = _run(_bwd_jax, ins, _IN_KINDS, {"impl": ctx.impl, "cfg": ctx.cfg}, ctx.sharded,
                     ("x", "x", "x", "x"), shapes)
        dq, dk, dv, dab = grads
        return dq, dk, dv, dab, None, None, None, None, None


def flash_attention(
    q: torch.Tensor,  # [batch, num_heads, q_seq_len, head_dim]
    k: torch.Tensor,  # [batch, num_heads, kv_seq_len, head_dim]
    v: torch.Tensor,  # [batch, num_heads, kv_seq_len, head_dim]
    causal: bool = False,
    q_segment_ids: Optional[torch.Tensor] = None,  # [batch, q_seq_len]
    kv_segment_ids: Optional[torch.Tensor] = None,  # [batch, kv_seq_len]
    sm_scale: float = 1.0,
    *,
    ab: Optional[torch.Tensor] = None,  # [batch, num_heads, q_seq_len, kv_seq_len]
    partition_spec: Optional[Sequence[Any]] = None,
    mesh: Optional[Any] = None,
) -> torch.Tensor:
    """softmax(q @ k^T * sm_scale + ab, masked) @ v, computed blockwise.

    `causal` lets query i see keys j <= i (aligned at the first position, as
    `scaled_dot_product_attention(is_causal=True)`); segment ids let a query see only keys
    of its own segment; `ab` is an additive bias. Leading dimensions before the head
    dimension are batch dimensions (segment ids then have them too). Differentiable in
    q, k, v and ab. Under SPMD, `partition_spec` (4 entries: batch, heads, sequence,
    head_dim) with `mesh` (an `xs.Mesh`, default the global mesh) shards the inputs and the
    result; each device computes its own batch / head slice.
    """
    _check_flash(q, k, v, q_segment_ids, kv_segment_ids, ab)
    lead = q.shape[:-3]
    if q.dim() != 4:
        flat = (lambda t, keep: None if t is None else t.reshape(-1, *t.shape[t.dim() - keep:]))
        q, k, v, ab = flat(q, 3), flat(k, 3), flat(v, 3), flat(ab, 3)
        q_segment_ids, kv_segment_ids = flat(q_segment_ids, 1), flat(kv_segment_ids, 1)
    qs = None if q_segment_ids is None else q_segment_ids.to(torch.int32)
    ks = None if kv_segment_ids is None else (qs if kv_segment_ids is q_segment_ids
                                              else kv_segment_ids.to(torch.int32))
    impl = _impl(q, k, ab, q_segment_ids, kv_segment_ids)
    cfg = _aj.FlashConfig(bool(causal), float(sm_scale), BLOCK_Q, BLOCK_K, _table.matmul_precision())
    sharded = None if partition_spec is None else _Sharded(partition_spec, mesh)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, ab)):
        out = _FlashAttention.apply(q, k, v, ab, qs, ks, impl, cfg, sharded)
    else:
        ins = {"q": q, "k": k, "v": v, "ab": ab, "qs": qs, "ks": ks}
        out, _ = _run(_fwd_jax, ins, _IN_KINDS, {"impl": impl, "cfg": cfg}, sharded, ("x", "row"),
                      (q.shape, tuple(q.shape[:3])))
    return out.reshape(*lead, *out.shape[1:]) if len(lead) != 1 else out


# ---------------------------------------------------------------------------------------
# paged attention

def _is_int(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _check_paged(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode) -> None:
    assert megacore_mode in ["kv_head", "batch", None], "megacore_mode must be one of ['kv_head', 'batch', None]."
    if q.dim() != 3:
        raise ValueError(f"paged_attention: q must be [batch, num_heads, head_dim], got {list(q.shape)}")
    if k_pages.dim() != 4:
        raise ValueError(f"paged_attention: k_pages must be [num_kv_heads, total_num_pages, page_size, head_dim], "
                         f"got {list(k_pages.shape)}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape. Got {list(k_pages.shape)} and "
                         f"{list(v_pages.shape)}")
    b, hq, d = q.shape
    hkv, _, _, dk = k_pages.shape
    if hq % hkv != 0:
        raise ValueError(f"Number of Q heads must be divisible by number of KV heads. Got {hq} and {hkv}.")
    if dk != d:
        raise ValueError(f"head_dim of Q must be the same as that of K/V. Got {d} and {dk}.")
    if page_indices.dim() != 2 or page_indices.shape[0] != b:
        raise ValueError(f"`page_indices` must be [batch, pages_per_sequence] with the batch size of `q` ({b}), "
                         f"got {list(page_indices.shape)}")
    if tuple(lengths.shape) != (b,):
        raise ValueError(f"`lengths` and `q` must have the same batch size, got {list(lengths.shape)} for q "
                         f"{list(q.shape)}")
    if not (_is_int(lengths) and _is_int(page_indices)):
        raise ValueError(f"`lengths` and `page_indices` must be integer tensors, got {lengths.dtype} and "
                         f"{page_indices.dtype}")
    ppc = pages_per_compute_block
    if not isinstance(ppc, int) or ppc <= 0 or page_indices.shape[1] % ppc != 0:
        raise ValueError(f"pages_per_compute_block must divide pages per sequence. Got {ppc} and "
                         f"{page_indices.shape[1]}.")


def _paged_jax(q, k_pages, v_pages, lengths, page_indices, *, pages_per_compute_block, megacore_mode,
               attn_logits_soft_cap, precision, tpu):
    if tpu:
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pallas_paged
        return pallas_paged(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=pages_per_compute_block,
                            megacore_mode=megacore_mode, attn_logits_soft_cap=attn_logits_soft_cap)
    return _aj.paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=pages_per_compute_block,
                               attn_logits_soft_cap=attn_logits_soft_cap, precision=precision)


def paged_attention(q: torch.Tensor,  # [batch, num_heads, head_dim]
                    k_pages: torch.Tensor,  # [num_kv_heads, total_num_pages, page_size, head_dim]
                    v_pages: torch.Tensor,  # [num_kv_heads, total_num_pages, page_size, head_dim]
                    lengths: torch.Tensor,  # i32[batch]
                    page_indices: torch.Tensor,  # i32[batch, pages_per_sequence]
                    pages_per_compute_block: int,
                    megacore_mode: Optional[str] = None,
                    attn_logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """One query per sequence attending to its keys/values stored in pages (decode).

    Sequence b's keys are pages `page_indices[b]` of `k_pages` (query head h reads
    key/value head h // (num_heads // num_kv_heads)), up to `lengths[b]`; the logits are
    unscaled (scale q beforehand) and soft-capped as cap * tanh(logits / cap) when
    `attn_logits_soft_cap` is set. Pages are read `pages_per_compute_block` at a time.
    `megacore_mode` ('kv_head', 'batch' or None) only splits the work between the cores of
    a TPU chip. Returns [batch, num_heads, head_dim] in q's dtype."""
    _check_paged(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode)
    cap = None if attn_logits_soft_cap is None else float(attn_logits_soft_cap)
    return _jax_call.call_jax(_paged_jax, (q, k_pages, v_pages, lengths.to(torch.int32), page_indices.to(torch.int32)),
                              {"pages_per_compute_block": int(pages_per_compute_block),
                               "megacore_mode": megacore_mode, "attn_logits_soft_cap": cap,
                               "precision": _table.matmul_precision(), "tpu": pjrt.platform() == "TPU"},
                              name="paged_attention")


def _check_ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap) -> None:
    if q.dim() != 3:
        raise ValueError(f"ragged_paged_attention: q must be [max_num_batched_tokens, num_q_heads, head_dim], "
                         f"got {list(q.shape)}")
    if kv_pages.dim() != 4:
        raise ValueError("ragged_paged_attention: kv_pages must be [total_num_pages, page_size, "
                         f"num_combined_kv_heads, head_dim], got {list(kv_pages.shape)}")
    _, hq, d = q.shape
    _, _, hc, dk = kv_pages.shape
    if dk != d:
        raise ValueError(f"Expected {d=} of q to match head_dim {dk} of kv_pages.")
    if hc % 2 != 0:
        raise ValueError(f"Expected num_combined_kv_heads={hc} to be even (keys and values interleaved).")
    if hq % (hc // 2) != 0:
        raise ValueError(f"Expected num_q_heads={hq} to be divisible by num_kv_heads={hc // 2}.")
    if kv_lens.dim() != 1 or page_indices.dim() != 2 or page_indices.shape[0] != kv_lens.shape[0]:
        raise ValueError(f"Expected kv_lens [max_num_seqs] and page_indices [max_num_seqs, pages_per_seq], got "
                         f"{list(kv_lens.shape)} and {list(page_indices.shape)}.")
    if tuple(cu_q_lens.shape) != (kv_lens.shape[0] + 1,):
        raise ValueError(f"Expected cu_q_lens of shape [{kv_lens.shape[0] + 1}], got {list(cu_q_lens.shape)}.")
    if tuple(num_seqs.shape) != (1,):
        raise ValueError(f"Expected num_seqs of shape [1], got {list(num_seqs.shape)}.")
    for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        if not _is_int(t):
            raise ValueError(f"Expected {name} to be an integer tensor, got {t.dtype}.")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive.")
    if soft_cap is not None and soft_cap == 0.0:
        raise ValueError(f"{soft_cap=} must not be 0.0.")


def _ragged_jax(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, tpu, precision, pages_per_block,
                queries_per_block, vmem_limit_bytes, **kw):
    if tpu:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as pallas_ragged
        return pallas_ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                             num_kv_pages_per_block=pages_per_block, num_queries_per_block=queries_per_block,
                             vmem_limit_bytes=vmem_limit_bytes, **kw)
    return _aj.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      pages_per_block=pages_per_block or 16, precision=precision, **kw)


def ragged_paged_attention(
    q: torch.Tensor,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages: torch.Tensor,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_lens: torch.Tensor,  # i32[max_num_seqs]
    page_indices: torch.Tensor,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: torch.Tensor,  # i32[max_num_seqs + 1]
    num_seqs: torch.Tensor,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: Optional[int] = None,
    soft_cap: Optional[float] = None,
    mask_value: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    use_kernel: bool = True,
    num_kv_pages_per_block: Optional[int] = None,
    num_queries_per_block: Optional[int] = None,
    vmem_limit_bytes: Optional[int] = None,
) -> torch.Tensor:
    """Attention of a batch of ragged sequences (mixed prefill and decode) over paged
    keys/values. See `_attention_jax.ragged_paged_attention` for the layout and masks.

    Rows of q past `cu_q_lens[num_seqs]` come back as zeros. `use_kernel=False` computes it
    with PyTorch ops, one sequence at a time (reads the lengths on the host and validates
    them). The block-size arguments tune the kernels (`num_kv_pages_per_block`: pages read
    per step)."""
    _check_ragged(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sliding_window, soft_cap)
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else float(mask_value)
    kw = {"sm_scale": float(sm_scale), "sliding_window": None if sliding_window is None else int(sliding_window),
          "soft_cap": None if soft_cap is None else float(soft_cap), "mask_value": mask_value,
          "k_scale": None if k_scale is None else float(k_scale), "v_scale": None if v_scale is None else float(v_scale)}
    if not use_kernel:
        return _ragged_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
    i32 = (kv_lens.to(torch.int32), page_indices.to(torch.int32), cu_q_lens.to(torch.int32), num_seqs.to(torch.int32))
    return _jax_call.call_jax(_ragged_jax, (q, kv_pages, *i32),
                              {"tpu": pjrt.platform() == "TPU", "precision": _table.matmul_precision(),
                               "pages_per_block": num_kv_pages_per_block, "queries_per_block": num_queries_per_block,
                               "vmem_limit_bytes": vmem_limit_bytes, **kw},
                              name="ragged_paged_attention")


def _ragged_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap,
                      mask_value, k_scale, v_scale) -> torch.Tensor:
    """`ragged_paged_attention` in PyTorch ops, sequence by sequence."""
    kv_lens_h, cu_h, n = kv_lens.cpu().tolist(), cu_q_lens.cpu().tolist(), int(num_seqs.cpu()[0])
    page_size, hc, d = kv_pages.shape[1], kv_pages.shape[2], kv_pages.shape[3]
    if n > len(kv_lens_h):
        raise ValueError(f"num_seqs={n} must be less or equal to max_num_seqs={len(kv_lens_h)}")
    if cu_h[n] > q.shape[0]:
        raise ValueError(f"Total q tokens {cu_h[n]} must be less or equal to max_num_batched_tokens={q.shape[0]}.")
    g = q.shape[1] // (hc // 2)
    out = torch.zeros_like(q)
    for i in range(n):
        q_len, kv_len = cu_h[i + 1] - cu_h[i], kv_lens_h[i]
        if q_len > kv_len:
            raise ValueError(f"q_len={q_len} must be less or equal to kv_len={kv_len} at sequence {i}.")
        if kv_len > page_indices.shape[1] * page_size:
            raise ValueError(f"kv_len={kv_len} of sequence {i} needs more than pages_per_seq="
                             f"{page_indices.shape[1]} pages of {page_size}.")
        kv = kv_pages[page_indices[i]].reshape(-1, hc, d)[:kv_len]
        k, v = kv[:, 0::2], kv[:, 1::2]
        if k_scale is not None:
            k = (k.float() * k_scale).to(q.dtype)
        if v_scale is not None:
            v = (v.float() * v_scale).to(q.dtype)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[cu_h[i]:cu_h[i + 1]], k).float() * sm_scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        ones = torch.ones(q_len, kv_len, device=s.device)
        masked = torch.triu(ones, diagonal=kv_len - q_len + 1).bool()
        if sliding_window is not None:
            masked |= torch.triu(ones, diagonal=kv_len - (q_len + sliding_window) + 1).bool().logical_not()
        p = torch.softmax(s.masked_fill(masked, mask_value), dim=-1).to(v.dtype)
        out[cu_h[i]:cu_h[i + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


# ---------------------------------------------------------------------------------------
# torch.ops.xla.* (what torch.compile graphs hold)

def _non_xla(q, *_, kind: str, **__) -> torch.Tensor:
    # Fake / meta tensors (Dynamo's tracing) only need the output's shape.
    if q.device.type != "meta":
        warnings.warn(f"XLA {kind} attention should only be applied to tensors on the XLA device")
    return torch.empty_like(q)


_SCHEMAS = {
    "flash_attention": "flash_attention(Tensor q, Tensor k, Tensor v, bool casual=False) -> Tensor",
    "paged_attention": ("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor lengths, "
                        "Tensor page_indices, int pages_per_compute_block, str? megacore_mode=None, "
                        "float? attn_logits_soft_cap=None) -> Tensor"),
    "ragged_paged_attention": ("ragged_paged_attention(Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, "
                               "Tensor cu_q_lens, Tensor num_seqs, float sm_scale=1, int? sliding_window=None, "
                               "float? soft_cap=None, float? mask_value=None, float? k_scale=None, "
                               "float? v_scale=None, bool use_kernel=True, int? num_kv_pages_per_block=None, "
                               "int? num_queries_per_block=None, int? vmem_limit_bytes=None) -> Tensor"),
}


def _flash_op(q, k, v, casual=False):
    return flash_attention(q, k, v, causal=casual)


def _paged_op(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode=None,
              attn_logits_soft_cap=None):
    return paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block, megacore_mode,
                           attn_logits_soft_cap)


def _ragged_op(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=1.0, sliding_window=None,
               soft_cap=None, mask_value=None, k_scale=None, v_scale=None, use_kernel=True,
               num_kv_pages_per_block=None, num_queries_per_block=None, vmem_limit_bytes=None):
    return ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                                  sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
                                  k_scale=k_scale, v_scale=v_scale, use_kernel=use_kernel,
                                  num_kv_pages_per_block=num_kv_pages_per_block,
                                  num_queries_per_block=num_queries_per_block, vmem_limit_bytes=vmem_limit_bytes)


def _register() -> None:
    if hasattr(torch.ops.xla, "flash_attention"):
        return   # a reload of this module: the ops exist
    kernels = {"flash_attention": (_flash_op, "flash"), "paged_attention": (_paged_op, "paged"),
               "ragged_paged_attention": (_ragged_op, "paged")}
    for name, (fn, kind) in kernels.items():
        _library.define("xla", _SCHEMAS[name])
        _library.impl_ns("xla", name, fn, "PrivateUse1")
        _library.impl_ns("xla", name, functools.partial(_non_xla, kind=kind), "CompositeExplicitAutograd")


_register()


# ---------------------------------------------------------------------------------------

def repeat_with_fixed_output_size(input: torch.Tensor, repeats: torch.Tensor,
                                  total_repeat_length: int) -> torch.Tensor:
    """`torch.repeat_interleave(input, repeats)` with a length known before the run:
    cut to `total_repeat_length`, or padded with `input`'s last element.

    Output position j takes the element whose run of repeats covers j (the first whose
    cumulative repeat count exceeds j), so the graph has no data-dependent shape.
    """
    if input.dim() != 1 or repeats.dim() != 1:
        raise ValueError(f"repeat_with_fixed_output_size takes 1-d input and repeats, got "
                         f"{input.dim()}-d and {repeats.dim()}-d")
    ends = torch.cumsum(repeats, 0)
    pos = torch.arange(total_repeat_length, dtype=ends.dtype, device=input.device)
    idx = torch.searchsorted(ends, pos, right=True).clamp(max=input.numel() - 1)
    return input[idx]

