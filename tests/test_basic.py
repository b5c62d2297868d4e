
import pytest
import torch

import torch_xla  # noqa: F401  (registers the xla device)
import torch_xla.core.xla_model as xm

from helpers import assert_same, check_op


def test_spec_add_prints_device():
    t1 = torch.tensor(100, device=xm.xla_device())
    t2 = torch.tensor(200, device=xm.xla_device())
    assert repr(t1 + t2) == "tensor(300, device='xla:0')"


def test_randn_device():
    t = torch.randn(2, 2, device=xm.xla_device())
    assert t.device == torch.device("xla:0")
    assert t.shape == (2, 2) and t.dtype == torch.float32


def test_arithmetic_matches_cpu():
    a = torch.randn(4, 5)
    b = torch.randn(4, 5)
    check_op(lambda x, y: (x + y) * 2 - y / 3, a, b)
    check_op(lambda x: x.int() + 1.5, a)
    check_op(lambda x, y: torch.where(x > y, x, y), a, b)


def test_item_tolist_numpy():
    a = torch.arange(6.0).reshape(2, 3)
    x = a.to("xla:0")
    assert x.sum().item() == a.sum().item()
    assert x.tolist() == a.tolist()
    assert (x.cpu().numpy() == a.numpy()).all()


def test_torch_tensor_with_device_is_a_normal_xla_tensor():
    t = torch.tensor([1, 2], dtype=torch.int32, device="xla:0")
    t.copy_(torch.ones(2, dtype=torch.int32, device="xla:0"))
    t.add_(torch.tensor([5, 6], dtype=torch.int32, device="xla:0"))
    assert t.tolist() == [6, 7]
    x = torch.tensor([1.0, 2.0], device="xla:0", requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.tolist() == [2.0, 4.0]


def test_inplace_elementwise_checks_match_cpu():
    cases = [
        (lambda a, b: a.add_(b), torch.zeros(3), torch.ones(2, 3)),      # broadcast beyond self
        (lambda a, b: a.add_(b), torch.zeros(3, dtype=torch.long), torch.ones(3)),  # float into long
        (lambda a, b: a.addcmul_(b, b, value=0.5), torch.zeros(3), torch.ones(4)),
    ]
    for f, a, b in cases:
        with pytest.raises(RuntimeError):
            f(a.clone(), b)
        with pytest.raises(RuntimeError):
            f(a.clone().to("xla:0"), b.to("xla:0"))
    x = torch.rand(3) + 1
    xd = x.to("xla:0")
    xd.pow_(2.0).add_(1.5).mul_(torch.full((3,), 0.5).to("xla:0"))
    assert_same(xd, (x.pow(2.0) + 1.5) * 0.5)
