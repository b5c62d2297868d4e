"""Gradient checkpointing, optimization barriers and gradient accumulation, against eager CPU."""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.experimental.gradient_accumulation import gradient_accumulation
from torch_xla.utils import checkpoint as xcp

from helpers import XLA, assert_same, to_xla


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.GELU(),
                               torch.nn.Linear(12, 3))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_matches_cpu(use_reentrant):
    ref, m = _model(), _model().to(XLA)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    xx = to_xla(x)
    out_ref = tc.checkpoint(ref[:4], x, use_reentrant=use_reentrant)
    ref[4](out_ref).pow(2).sum().backward()
    out = xcp.checkpoint(m[:4], xx, use_reentrant=use_reentrant)
    m[4](out).pow(2).sum().backward()
    assert_same(out, out_ref)
    assert_same(xx.grad, x.grad)
    assert_same([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])


def test_checkpoint_replays_dropout_and_sequential():
    w = torch.randn(8, generator=torch.Generator().manual_seed(2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    xx, ww = to_xla(x).requires_grad_(), to_xla(w).requires_grad_()
    y = xcp.checkpoint(lambda a, b: F.dropout(a, 0.5, training=True) * b, xx, ww)
    y.sum().backward()
    # The recomputed dropout used the forward's mask: d y.sum()/d x = mask * 2 * w.
    yc = y.detach().cpu()
    mask = (yc != 0).float()
    assert_same(xx.grad, mask * 2 * w)
    assert_same(ww.grad, (yc / w).sum(0))
    ref, m = _model(), _model().to(XLA)
    out_ref = tc.checkpoint_sequential(ref, 2, x[:, :6], use_reentrant=True)
    out = xcp.checkpoint_sequential(m, 2, to_xla(x[:, :6]))
    assert_same(out, out_ref)
    with pytest.raises(ValueError, match="Unexpected keyword"):
        xcp.checkpoint(lambda a: a, xx, foo=1)


def test_checkpointed_module_recomputes_behind_one_barrier_with_its_weights():
    """A checkpointed module's recomputation starts behind one optimization barrier that
    holds its input, the incoming gradient, its parameters and buffers; gradients match
    the CPU's checkpoint."""
    from torch_xla.distributed.fsdp import checkpoint_module
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8)
    ref.register_buffer("buf", torch.zeros(3, 3))
    m = checkpoint_module(copy.deepcopy(ref).to(XLA))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    xx = to_xla(x).detach().requires_grad_()
    tc.checkpoint(ref, x, use_reentrant=True).pow(2).sum().backward()
    m(xx).pow(2).sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([m.weight.grad])
    barrier = next(line for line in hlo.splitlines() if "opt-barrier(" in line)
    result = barrier.split("opt-barrier(")[0]
    # input, gradient, weight: f32[4,8] x2 and f32[8,8]; bias f32[8]; buffer f32[3,3]
    assert [result.count(s) for s in ("f32[4,8]", "f32[8,8]", "f32[8]", "f32[3,3]")] == [2, 1, 1, 1], barrier
    assert_same(m.weight.grad, ref.weight.grad)
    assert_same(m.bias.grad, ref.bias.grad)
    assert_same(xx.grad, x.grad)


def test_optimization_barrier_is_in_the_graph_and_keeps_values():
    a = torch.randn(3, 4)
    b = torch.arange(5)
    xa, xb = to_xla(a), to_xla(b)
    xa = xa * 2
    xm.optimization_barrier_([xa, xb])
    assert "optimization_barrier" in xm.get_stablehlo([xa])
    assert_same(xa + 1, a * 2 + 1)
    assert_same(xb, b)


def test_gradient_accumulation_matches_manual_cpu_loop():
    ref, m = _model(), _model().to(XLA)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    y = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    c = torch.tensor([5, 5])
    total = torch.zeros(())
    cc = c
    for i in range(4):
        loss = F.mse_loss(ref(x[i]), y[i]) / 4
        loss.backward()
        total = total + loss.detach()
        cc = cc + 5

    def step(xi, yi, carried):
        return F.mse_loss(m(xi), yi), carried + 5

    got, got_c = gradient_accumulation(step, (to_xla(x), to_xla(y)), m, to_xla(c))
    torch_xla.sync()
    assert_same(got, total)
    assert_same(got_c, cc)
    assert_same([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()])
    m2 = copy.deepcopy(m)
    assert_same(gradient_accumulation(lambda xi: m2(xi).sum(), (to_xla(x),), m2), ref(x).sum(1).mean())
    with pytest.raises(ValueError, match="inconsistent first dimension"):
        gradient_accumulation(step, (to_xla(x), to_xla(y[:2])), m, to_xla(c))
    with pytest.raises(ValueError, match="cannot be empty"):
        gradient_accumulation(step, (), m)

    def impure(xi, yi, carried):
        carried += 1
        return F.mse_loss(m(xi), yi), carried

    with pytest.raises(AssertionError, match="in place"):
        gradient_accumulation(impure, (to_xla(x), to_xla(y)), m, to_xla(c))
