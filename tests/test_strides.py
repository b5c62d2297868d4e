"""Transpositions report eager's strides; what reads strides (autograd's product
derivatives, `as_strided`) agrees with eager PyTorch on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torch_xla
from helpers import XLA, assert_same, to_cpu


# (input shape, view, whether its strides are eager's: transpositions and what undoes
# them are; other views report contiguous strides, so only their values are compared).
_VIEWS = [
    ((4, 3), lambda x: x.t(), True),
    ((4, 3), lambda x: x.transpose(0, 1), True),
    ((4, 3), lambda x: x.permute(1, 0), True),
    ((4, 3), lambda x: x.mT, True),
    ((4, 3), lambda x: x.t().t(), True),
    ((2, 4, 3), lambda x: x.transpose(0, 2), True),
    ((2, 4, 3), lambda x: x.permute(2, 0, 1), True),
    ((2, 4, 3), lambda x: x.mT, True),
    ((2, 4, 3), lambda x: x.transpose(1, 2).transpose(0, -1), True),
    ((2, 4, 3), lambda x: x.permute(1, 2, 0).permute(2, 0, 1), True),
    ((2, 4, 3), lambda x: x.transpose(0, 1)[1], False),
    ((2, 4, 3), lambda x: x.permute(0, 2, 1).reshape(2, 12), False),
    ((4, 3), lambda x: x.t().unsqueeze(0), False),
    ((4, 3), lambda x: x.t().detach(), True),
    ((4, 3), lambda x: torch.nn.Parameter(x.t()), True),
]


@pytest.mark.parametrize("shape, view, strided", _VIEWS)
def test_transposition_strides_are_eagers(shape, view, strided):
    x = torch.randn(shape)
    want = view(x)
    got = view(x.to(XLA))
    assert_same(got, want)
    if strided:
        assert got.stride() == want.stride()
        assert got.is_contiguous() == want.is_contiguous()


def test_weight_gradient_is_one_product():
    lin = torch.nn.Linear(3, 4)
    x = torch.randn(5, 3)
    ref = copy.deepcopy(lin)
    ref(x).square().sum().backward()
    dev = copy.deepcopy(lin).to(XLA)
    dev(x.to(XLA)).square().sum().backward()
    # The gradient is gᵀ·x, in the weight's own layout: no transpose of a product (the
    # product xᵀ·g would also be kept alive as the transpose's base).
    root = [line for line in torch_xla._XLAC._get_xla_tensors_text([dev.weight.grad]).splitlines()
            if "ROOT" in line]
    assert len(root) == 1 and "aten::mm(" in root[0]
    assert dev.weight.grad.stride() == ref.weight.grad.stride()
    assert_same(dev.weight.grad, ref.weight.grad)
    assert_same(dev.bias.grad, ref.bias.grad)


def test_transposition_undone_is_its_input():
    cpu = torch.randn(3, 4)
    x = cpu.to(XLA) * 2
    a, b = x.t().t(), x.permute(1, 0).transpose(0, 1)
    text = torch_xla._XLAC._get_xla_tensors_text([a, b])
    assert "t_copy" not in text and "permute_copy" not in text and "transpose_copy" not in text
    assert_same(a, (cpu * 2).t().t())
    assert_same(b, (cpu * 2).permute(1, 0).transpose(0, 1))


def test_as_strided_reads_a_transposition_in_storage_order():
    w = torch.randn(4, 3)
    for fn in (lambda t: t.t().as_strided((4, 3), (3, 1)),
               lambda t: torch.as_strided(t.t(), t.t().size(), t.t().stride()),
               lambda t: t.permute(1, 0).as_strided((2, 2), (1, 3), 1),
               lambda t: t.unsqueeze(0).permute(2, 0, 1).as_strided((3, 4), (1, 3))):
        assert_same(fn(w.to(XLA)), fn(w))


def test_as_strided_scatter_writes_a_transposition_in_storage_order():
    w = torch.randn(4, 3)

    def fn(t):
        return torch.as_strided_scatter(t.t(), torch.ones(2, device=t.device), (2,), (1,), 1)
    got, want = fn(w.to(XLA)), fn(w)
    assert_same(got, want)
    assert got.stride() == want.stride()


def test_half_precision_gradients_keep_eagers_rounding():
    """A bfloat16 product's gradient cast to a float32 weight is rounded to bfloat16 first,
    as eager rounds it (XLA would drop the round trip as excess precision)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    grads = {}
    for dev in ("cpu", XLA):
        mm = copy.deepcopy(m).to(dev)
        with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16):
            loss = F.mse_loss(mm(x.to(dev)), y.to(dev))
        (loss * 1024).backward()
        grads[str(dev)] = [to_cpu(p.grad) for p in mm.parameters()]
    for got, want in zip(grads[str(XLA)], grads["cpu"]):
        assert torch.equal(got, want)
