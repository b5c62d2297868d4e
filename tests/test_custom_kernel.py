"""`torch_xla.experimental.custom_kernel` attention kernels against eager PyTorch on the CPU:
flash attention (values and gradients against `scaled_dot_product_attention`), paged and
ragged paged attention (against attention over the keys gathered from the pages), the
`torch.ops.xla.*` ops and bad input."""
import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.experimental.custom_kernel as ck
from torch_xla.experimental.custom_kernel import flash_attention, paged_attention, ragged_paged_attention

from helpers import XLA


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # several query and key blocks (and a ragged last one) at test sizes
    monkeypatch.setattr(ck, "BLOCK_Q", 8)
    monkeypatch.setattr(ck, "BLOCK_K", 8)


def _qkv(b=2, h=3, lq=37, lk=29, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, h, lk, d, generator=g),
            torch.randn(b, h, lk, d, generator=g))


def _segments(b, lq, lk, seed=1):
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(0, 3, (b, lq), generator=g)
    ks = torch.randint(0, 3, (b, lk), generator=g)
    n = min(lq, lk)
    ks[:, :n] = qs[:, :n]   # every query sees a key of its segment, causal or not (no empty row)
    return qs, ks


def _sdpa_mask(lq, lk, causal, qs, ks):
    """The boolean attn_mask of SDPA (True: attend) for a causal mask and segment ids."""
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    keep = keep[None, None]
    if qs is not None:
        keep = keep & (qs[:, None, :, None] == ks[:, None, None, :])
    return keep


def _compare(q, k, v, *, causal=False, sm_scale=1.0, segments=None, ab=None, atol=2e-5):
    """Output and gradients of flash_attention on the device == SDPA's on the CPU."""
    qs, ks = segments if segments is not None else (None, None)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)] + ([ab.clone().requires_grad_()] if ab is not None else [])
    dev = [t.to(XLA).requires_grad_() for t in (q, k, v)] + ([ab.to(XLA).requires_grad_()] if ab is not None else [])
    mask = _sdpa_mask(q.shape[2], k.shape[2], causal, qs, ks)
    attn_mask = None
    if ab is not None:
        attn_mask = cpu[3] + torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif causal or qs is not None:
        attn_mask = mask
    ref = F.scaled_dot_product_attention(cpu[0], cpu[1], cpu[2], attn_mask=attn_mask, scale=sm_scale)
    out = flash_attention(dev[0], dev[1], dev[2], causal, None if qs is None else qs.to(XLA),
                          None if ks is None else ks.to(XLA), sm_scale, ab=dev[3] if ab is not None else None)
    assert out.device.type == "xla" and out.shape == ref.shape and out.dtype == ref.dtype
    torch_xla.sync()   # one program for the step's forward, one for its backward (as in training)
    torch.testing.assert_close(out.cpu(), ref.detach(), atol=atol, rtol=1e-5)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    ref.backward(cot)
    out.backward(cot.to(XLA))
    torch_xla.sync()
    for name, c, d in zip("q k v ab".split(), cpu, dev):
        assert d.grad is not None, name
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=atol * 5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flash_matches_sdpa(causal):
    _compare(*_qkv(), causal=causal, sm_scale=0.35)


def test_flash_square_causal_and_default_scale():
    _compare(*_qkv(b=1, h=2, lq=24, lk=24), causal=True)


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flash_segment_ids(causal):
    q, k, v = _qkv(lq=21, lk=21)
    _compare(q, k, v, causal=causal, sm_scale=0.5, segments=_segments(2, 21, 21))


@pytest.mark.slow
def test_flash_segment_ids_cross_lengths():
    q, k, v = _qkv(lq=13, lk=30)
    _compare(q, k, v, sm_scale=0.5, segments=_segments(2, 13, 30))


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flash_bias(causal):
    q, k, v = _qkv(lq=19, lk=26)
    ab = torch.randn(2, 3, 19, 26, generator=torch.Generator().manual_seed(3))
    _compare(q, k, v, causal=causal, sm_scale=0.4, ab=ab)


@pytest.mark.slow
def test_flash_bias_and_segments():
    q, k, v = _qkv(lq=17, lk=17)
    ab = torch.randn(2, 3, 17, 17, generator=torch.Generator().manual_seed(4))
    _compare(q, k, v, sm_scale=0.3, ab=ab, segments=_segments(2, 17, 17))


def test_flash_one_block_and_no_grad():
    q, k, v = _qkv(lq=5, lk=6)
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    with torch.no_grad():
        out = flash_attention(q.to(XLA), k.to(XLA), v.to(XLA))
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_flash_leading_batch_dims():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 3, 11, 8, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    out = flash_attention(q.to(XLA), k.to(XLA), v.to(XLA), causal=True, sm_scale=0.5)
    assert out.shape == (2, 2, 3, 11, 8)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_flash_bfloat16():
    q, k, v = (t.bfloat16() for t in _qkv(lq=16, lk=16))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.3)
    out = flash_attention(q.to(XLA), k.to(XLA), v.to(XLA), causal=True, sm_scale=0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)


def test_flash_op_and_compile():
    q, k, v = _qkv(lq=16, lk=16)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    out = torch.ops.xla.flash_attention(q.to(XLA), k.to(XLA), v.to(XLA), True)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)

    def f(q, k, v):
        return torch.ops.xla.flash_attention(q, k, v, True) * 2

    compiled = torch.compile(f, backend="openxla")
    with torch.no_grad():
        got = compiled(q.to(XLA), k.to(XLA), v.to(XLA))
    torch.testing.assert_close(got.cpu(), ref * 2, atol=4e-5, rtol=1e-5)


@pytest.mark.parametrize("args, match", [
    (dict(k=torch.zeros(2, 3, 29, 4)), "head dimensions differ"),
    (dict(v=torch.zeros(2, 3, 28, 8)), "sequence lengths differ"),
    (dict(k=torch.zeros(2, 4, 29, 8)), "batch / head dimensions differ"),
    (dict(ab=torch.zeros(2, 3, 37, 28)), r"ab must have shape \[2, 3, 37, 29\]"),
    (dict(q_segment_ids=torch.zeros(2, 37, dtype=torch.long)), "give both"),
    (dict(q_segment_ids=torch.zeros(2, 36, dtype=torch.long), kv_segment_ids=torch.zeros(2, 29, dtype=torch.long)),
     r"q_segment_ids must have shape \[2, 37\]"),
    (dict(q_segment_ids=torch.zeros(2, 37), kv_segment_ids=torch.zeros(2, 29)), "integer tensor"),
])
def test_flash_bad_input(args, match):
    q, k, v = _qkv()
    kw = dict(q=q, k=k, v=v)
    kw.update(args)
    kw = {n: t.to(XLA) for n, t in kw.items()}
    with pytest.raises(ValueError, match=match):
        flash_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_flash_cpu_tensors_refused():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="same device"):
        flash_attention(q.to(XLA), k, v.to(XLA))


# ---------------------------------------------------------------------------------------
# paged attention

def _pages(hkv=2, total_pages=13, page_size=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hkv, total_pages, page_size, d, generator=g),
            torch.randn(hkv, total_pages, page_size, d, generator=g))


def _paged_reference(q, k_pages, v_pages, lengths, page_indices, soft_cap=None):
    """Attention of each sequence's query over the keys gathered from its pages (CPU)."""
    hkv, _, page_size, d = k_pages.shape
    g = q.shape[1] // hkv
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k = k_pages[:, page_indices[b]].reshape(hkv, -1, d)[:, :n].repeat_interleave(g, 0)   # [Hq, n, d]
        v = v_pages[:, page_indices[b]].reshape(hkv, -1, d)[:, :n].repeat_interleave(g, 0)
        s = torch.einsum("hd,hkd->hk", q[b], k)
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        outs.append(torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("hq, soft_cap, ppcb", [(2, None, 2), (4, None, 1), (6, 5.0, 4)])
def test_paged_attention_matches_gathered_reference(hq, soft_cap, ppcb):
    k_pages, v_pages = _pages()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, hq, 8, generator=g)
    page_indices = torch.stack([torch.randperm(13, generator=g)[:4] for _ in range(3)]).int()
    lengths = torch.tensor([5, 16, 1], dtype=torch.int32)
    ref = _paged_reference(q, k_pages, v_pages, lengths, page_indices, soft_cap)
    out = paged_attention(q.to(XLA), k_pages.to(XLA), v_pages.to(XLA), lengths.to(XLA), page_indices.to(XLA),
                          ppcb, attn_logits_soft_cap=soft_cap)
    assert out.shape == (3, hq, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)
    op = torch.ops.xla.paged_attention(q.to(XLA), k_pages.to(XLA), v_pages.to(XLA), lengths.to(XLA),
                                       page_indices.to(XLA), ppcb, None, soft_cap)
    torch.testing.assert_close(op.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("change, exc, match", [
    (dict(v_pages=torch.zeros(2, 13, 4, 7)), ValueError, "same shape"),
    (dict(q=torch.zeros(3, 3, 8)), ValueError, "divisible by number of KV heads"),
    (dict(q=torch.zeros(3, 2, 4)), ValueError, "head_dim of Q"),
    (dict(lengths=torch.zeros(2, dtype=torch.int32)), ValueError, "same batch size"),
    (dict(page_indices=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "page_indices"),
    (dict(pages_per_compute_block=3), ValueError, "pages_per_compute_block"),
    (dict(lengths=torch.zeros(3)), ValueError, "integer"),
    (dict(megacore_mode="core"), AssertionError, "megacore_mode"),
])
def test_paged_attention_bad_input(change, exc, match):
    k_pages, v_pages = _pages()
    args = dict(q=torch.zeros(3, 2, 8), k_pages=k_pages, v_pages=v_pages, lengths=torch.ones(3, dtype=torch.int32),
                page_indices=torch.zeros(3, 4, dtype=torch.int32), pages_per_compute_block=2, megacore_mode=None)
    args.update(change)
    args = {n: a.to(XLA) if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    with pytest.raises(exc, match=match):
        paged_attention(**args)


# ---------------------------------------------------------------------------------------
# ragged paged attention

def _ragged_case(hq=4, hkv=2, d=8, page_size=4, total_pages=32, pages_per_seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_pages = torch.randn(total_pages, page_size, 2 * hkv, d, generator=g)
    q_lens, kv_lens = [3, 1, 6, 1], [9, 4, 6, 17]   # prefill chunks and decodes
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)) + [11, 11], dtype=torch.int32)  # 2 unused slots
    kv_lens_t = torch.tensor(kv_lens + [0, 0], dtype=torch.int32)
    page_indices = torch.randperm(total_pages, generator=g)[:6 * pages_per_seq].reshape(6, pages_per_seq).int()
    q = torch.randn(14, hq, d, generator=g)   # 11 real tokens, 3 padding rows
    return q, kv_pages, kv_lens_t, page_indices, cu, torch.tensor([4], dtype=torch.int32), q_lens, kv_lens


def _ragged_reference(q, kv_pages, page_indices, q_lens, kv_lens, sm_scale, sliding_window=None, soft_cap=None):
    """Each sequence's new tokens attending causally to its keys gathered from its pages (CPU)."""
    _, page_size, hc, d = kv_pages.shape
    g = q.shape[1] // (hc // 2)
    out = torch.zeros_like(q)
    start = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        kv = kv_pages[page_indices[i]].reshape(-1, hc, d)[:kl]
        k, v = kv[:, 0::2].repeat_interleave(g, 1), kv[:, 1::2].repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + ql], k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(kl - ql, kl)[:, None]
        col = torch.arange(kl)[None, :]
        keep = col <= pos
        if sliding_window is not None:
            keep &= col > pos - sliding_window
        s = s.masked_fill(~keep, float("-inf"))
        out[start:start + ql] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        start += ql
    return out


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=3), dict(soft_cap=4.0), dict(num_kv_pages_per_block=2)])
def test_ragged_paged_attention_matches_reference(kw):
    q, kv_pages, kv_lens, page_indices, cu, num_seqs, q_lens, kv_lens_l = _ragged_case()
    ref = _ragged_reference(q, kv_pages, page_indices, q_lens, kv_lens_l, 0.3, kw.get("sliding_window"),
                            kw.get("soft_cap"))
    args = [t.to(XLA) for t in (q, kv_pages, kv_lens, page_indices, cu, num_seqs)]
    out = ragged_paged_attention(*args, sm_scale=0.3, **kw)
    assert out.shape == q.shape
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)
    if "sliding_window" in kw:   # the PyTorch path (one sequence at a time: several programs)
        slow = ragged_paged_attention(*args, sm_scale=0.3, use_kernel=False, **kw)
        torch.testing.assert_close(slow.cpu(), ref, atol=2e-5, rtol=1e-5)


def test_ragged_paged_attention_op_and_scales():
    q, kv_pages, kv_lens, page_indices, cu, num_seqs, q_lens, kv_lens_l = _ragged_case(hq=2, hkv=2)
    scaled = kv_pages.clone()
    scaled[:, :, 0::2] *= 0.5
    scaled[:, :, 1::2] *= 2.0
    ref = _ragged_reference(q, scaled, page_indices, q_lens, kv_lens_l, 1.0)
    args = [t.to(XLA) for t in (q, kv_pages, kv_lens, page_indices, cu, num_seqs)]
    out = torch.ops.xla.ragged_paged_attention(*args, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("i, bad, match", [
    (1, torch.zeros(32, 4, 3, 8), "even"),
    (1, torch.zeros(32, 4, 4, 6), "head_dim"),
    (4, torch.zeros(6, dtype=torch.int32), "cu_q_lens"),
    (5, torch.zeros(2, dtype=torch.int32), "num_seqs"),
    (3, torch.zeros(5, 5, dtype=torch.int32), "page_indices"),
])
def test_ragged_paged_attention_bad_input(i, bad, match):
    args = list(_ragged_case()[:6])
    args[i] = bad
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(*[t.to(XLA) for t in args])


def test_ragged_reference_validates_lengths():
    q, kv_pages, kv_lens, page_indices, cu, num_seqs, *_ = _ragged_case()
    kv_lens = kv_lens.clone()
    kv_lens[1] = 0   # fewer keys than new tokens
    args = [t.to(XLA) for t in (q, kv_pages, kv_lens, page_indices, cu, num_seqs)]
    with pytest.raises(ValueError, match="must be less or equal to kv_len"):
        ragged_paged_attention(*args, use_kernel=False)


def test_non_xla_op_warns_and_keeps_shape():
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match="XLA device"):
        out = torch.ops.xla.flash_attention(q, k, v, False)
    assert out.shape == q.shape
    torch_xla.sync()
