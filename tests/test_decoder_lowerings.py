"""The pieces of the benchmark decoder (bench/models_torch.py) on the xla device against
eager PyTorch on the CPU, values and gradients: grouped-query causal attention
(repeat_interleave, matmul, mask, softmax, and the transposed products of their
backward), RMSNorm, the SiLU-gated MLP, embedding backward with repeated indices, the
output projection with cross entropy, and one Adam step. Small sizes, seconds each.
"""
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_xla.core.xla_model as xm

from helpers import XLA, assert_same

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import models_torch as mt  # noqa: E402

CFG = mt.DecoderConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_seq=32)
B, S = 2, 32


def _fwd_bwd(mod_cpu, fn, *inputs):
    """Runs fn(module, *inputs) forward and backward on the CPU and on the device with
    the same weights; compares outputs, input gradients and weight gradients."""
    mod_xla = _copy_module(mod_cpu)
    cin = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    xin = [t.detach().to(XLA).requires_grad_(t.is_floating_point()) for t in inputs]
    cout = fn(mod_cpu, *cin)
    xout = fn(mod_xla, *xin)
    g = torch.linspace(-1.0, 1.0, cout.numel()).reshape(cout.shape)
    cout.backward(g)
    xout.backward(g.to(XLA))
    xm.mark_step()
    assert_same(xout, cout, rtol=2e-5, atol=2e-5)
    for c, x in zip(cin, xin):
        if c.requires_grad:
            assert_same(x.grad, c.grad, rtol=2e-5, atol=2e-5)
    for (name, pc), (_, px) in zip(mod_cpu.named_parameters(), mod_xla.named_parameters()):
        assert px.grad is not None, name
        assert_same(px.grad, pc.grad, rtol=2e-5, atol=2e-5)


def _copy_module(mod):
    return copy.deepcopy(mod).to(XLA)


def test_attention_gqa_causal():
    torch.manual_seed(0)
    attn = mt.Attention(CFG)
    hd = CFG.hidden_size // CFG.num_attention_heads
    cos, sin = (t[:S] for t in mt.rotary_tables(CFG.max_seq, hd))
    mask = torch.full((S, S), float("-inf")).triu(1)
    x = torch.randn(B, S, CFG.hidden_size)

    def fn(m, x):
        dev = x.device
        return m(x, cos.to(dev), sin.to(dev), mask.to(dev))
    _fwd_bwd(attn, fn, x)


@pytest.mark.parametrize("lhs_t", [False, True])
@pytest.mark.parametrize("rhs_t", [False, True])
def test_bmm_transposed_operands(lhs_t, rhs_t):
    # The attention backward's products: a transposed left or right operand, the big
    # (scores-sized) one on either side.
    torch.manual_seed(0)
    p = torch.randn(6, S, S)
    v = torch.randn(6, S, 8)

    def fn(p, v):
        a = p.transpose(1, 2) if lhs_t else p
        b = v if not rhs_t else v.transpose(1, 2).contiguous().transpose(1, 2)
        return torch.bmm(a, b)
    cp, cv = p.clone().requires_grad_(), v.clone().requires_grad_()
    xp, xv = p.to(XLA).requires_grad_(), v.to(XLA).requires_grad_()
    co, xo = fn(cp, cv), fn(xp, xv)
    g = torch.randn(co.shape)
    co.backward(g)
    xo.backward(g.to(XLA))
    assert_same(xo, co, rtol=1e-5, atol=1e-5)
    assert_same(xp.grad, cp.grad, rtol=1e-5, atol=1e-5)
    assert_same(xv.grad, cv.grad, rtol=1e-5, atol=1e-5)


def test_causal_softmax_rows_fully_masked_but_first():
    # Row 0 of a causal mask keeps a single score: its softmax is exactly 1 there.
    torch.manual_seed(0)
    s = torch.randn(2, 3, S, S)
    mask = torch.full((S, S), float("-inf")).triu(1)
    cs, xs = s.clone().requires_grad_(), s.to(XLA).requires_grad_()
    co = F.softmax(cs / 3.0 + mask, dim=-1)
    xo = F.softmax(xs / 3.0 + mask.to(XLA), dim=-1)
    g = torch.randn(co.shape)
    co.backward(g)
    xo.backward(g.to(XLA))
    assert_same(xo, co)
    assert_same(xs.grad, cs.grad)
    assert torch.equal(xo[..., 0, 0].cpu(), torch.ones(2, 3))


def test_repeat_interleave_heads_grad():
    torch.manual_seed(0)
    k = torch.randn(B, CFG.num_key_value_heads, S, 16)
    ck, xk = k.clone().requires_grad_(), k.to(XLA).requires_grad_()
    co = ck.repeat_interleave(2, dim=1)
    xo = xk.repeat_interleave(2, dim=1)
    g = torch.randn(co.shape)
    co.backward(g)
    xo.backward(g.to(XLA))
    assert_same(xo, co, rtol=0, atol=0)
    assert_same(xk.grad, ck.grad)


def test_rmsnorm():
    torch.manual_seed(0)
    norm = mt.RMSNorm(CFG.hidden_size, CFG.rms_eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    _fwd_bwd(norm, lambda m, x: m(x), torch.randn(B, S, CFG.hidden_size))


def test_mlp():
    torch.manual_seed(0)
    _fwd_bwd(mt.MLP(CFG), lambda m, x: m(x), torch.randn(B, S, CFG.hidden_size))


def test_embedding_backward_repeated_indices():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(CFG.vocab_size, CFG.hidden_size)
    ids = torch.randint(0, 8, (B, S))      # few distinct rows: many gradients add up per row
    xemb = _copy_module(emb)
    g = torch.randn(B, S, CFG.hidden_size)
    emb(ids).backward(g)
    xemb(ids.to(XLA)).backward(g.to(XLA))
    assert_same(xemb.weight.grad, emb.weight.grad)


def test_output_projection_cross_entropy():
    torch.manual_seed(0)
    head = torch.nn.Linear(CFG.hidden_size, CFG.vocab_size, bias=False)
    labels = torch.randint(0, CFG.vocab_size, (B * S,))

    def fn(m, x):
        return F.cross_entropy(m(x).view(-1, CFG.vocab_size), labels.to(x.device))
    _fwd_bwd(head, fn, torch.randn(B, S, CFG.hidden_size))


@pytest.mark.slow   # ~10 s: three Adam steps of the whole decoder, twice
def test_decoder_steps_match_eager_and_repeat_bit_for_bit():
    """Three Adam steps of the whole decoder: losses and weights match eager CPU, and a
    second run on the device from the same seed gives the same bits."""
    wl = mt.decoder_workload(B, S, CFG)
    ids, labels = wl.make_batch(0)

    def run(dev):
        torch.manual_seed(0)
        model = wl.make_model().to(dev)
        opt = wl.make_opt(model.parameters())
        x, y = ids.to(dev), labels.to(dev)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = wl.loss_fn(model, x, y)
            loss.backward()
            opt.step()
            if dev.type == "xla":
                xm.mark_step()
            losses.append(loss.detach().cpu())
        return torch.stack(losses), [p.detach().cpu() for p in model.parameters()]

    closs, cparams = run(torch.device("cpu"))
    xloss, xparams = run(XLA)
    xloss2, xparams2 = run(XLA)
    assert_same(xloss, closs, rtol=1e-5, atol=1e-5)
    for a, b in zip(xparams, cparams):
        assert_same(a, b, rtol=1e-4, atol=2e-5)
    assert torch.equal(xloss, xloss2)
    assert all(torch.equal(a, b) for a, b in zip(xparams, xparams2))
