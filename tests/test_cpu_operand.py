"""A CPU tensor (not 0-d) as an operand of an op on xla tensors: copied to the device, as
PyTorch/XLA does, with a warning naming the line once; `XLA_CPU_OPERAND=error` keeps
PyTorch's same-device error."""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from helpers import assert_same
from torch_xla._engine import env_vars

SAME_DEVICE = r"Expected all tensors to be on the same device, but found at least two devices, xla:0 and cpu!"

BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b + 2),
    "gt": lambda a, b: a > b,
    "maximum": torch.maximum,
    "atan2": torch.atan2,
    "where": lambda a, b: torch.where(a > 0, a, b),
    "cat": lambda a, b: torch.cat([a, b]),
    "stack": lambda a, b: torch.stack([a, b], 1),
    "matmul": lambda a, b: a @ b.T,
    "addcmul": lambda a, b: torch.addcmul(a, b, a, value=0.5),
    "lerp": lambda a, b: torch.lerp(a, b, 0.25),
    "broadcast": lambda a, b: a * b[0],
}


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("name", list(BINARY))
def test_both_orders_match_cpu(name, quiet):
    fn = BINARY[name]
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    xa = a.to("xla")
    for got, want in ((fn(xa, b), fn(a, b)), (fn(b, xa), fn(b, a))):
        assert got.device.type == "xla"
        assert_same(got, want)


def test_binaryop_order(quiet):
    x, y = torch.rand(5), torch.rand(5)
    xx = x.to("xla")
    assert_same(xx + y, x + y)
    assert_same(y + xx, y + x)
    assert torch.equal((xx + y).cpu(), (y + xx).cpu())


def test_in_place_and_dtypes(quiet):
    a = torch.randn(4, 3)
    b = torch.randint(0, 5, (4, 3))
    xa = a.to("xla")
    xa.add_(b)
    assert_same(xa, a + b)
    mask = torch.tensor([True, False, True])
    assert_same(a.to("xla") * mask, a * mask)


def test_gradient_of_the_device_operand(quiet):
    a = torch.randn(3, requires_grad=True)
    c = torch.randn(3)
    xa = a.detach().to("xla").requires_grad_()
    (xa * c).sum().backward()
    (a * c).sum().backward()
    assert_same(xa.grad, a.grad)


def test_cpu_fallback_op(quiet):
    # histogram takes the CPU fallback: the CPU operand is used there as it is.
    x, bins = torch.rand(8), torch.linspace(0, 1, 5)
    got = torch.histogram(x.to("xla"), bins)
    assert_same(got.hist, torch.histogram(x, bins).hist)


def test_zero_dim_cpu_tensor_is_a_scalar():
    x = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no copy, no warning
        assert_same(x.to("xla") * torch.tensor(2.5), x * torch.tensor(2.5))


def test_warning_names_the_line_once():
    x, y = torch.rand(5), torch.rand(5)
    xx = x.to("xla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            line = inspect.currentframe().f_lineno + 1
            z = xx + y
        w = xx * y; line2 = inspect.currentframe().f_lineno  # noqa: E702
    assert_same(z, x + y)
    assert_same(w, x * y)
    mine = [c for c in caught if "CPU tensor" in str(c.message)]
    assert [(c.filename, c.lineno, c.category) for c in mine] == [(__file__, line, UserWarning),
                                                                  (__file__, line2, UserWarning)]
    msg = str(mine[0].message)
    assert msg.startswith("aten::add.Tensor: an operand is a CPU tensor (torch.float32[5])")
    assert f"{__file__}:{line}" in msg and "XLA_CPU_OPERAND=error" in msg


def test_error_switch():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    xa = a.to("xla")
    with env_vars.overlay({"XLA_CPU_OPERAND": "error"}):
        # PyTorch's own check of two devices, as with a CUDA and a CPU tensor
        with pytest.raises(RuntimeError, match=SAME_DEVICE + r" \(when checking argument for aten::add.Tensor\)"):
            xa + b
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            b * xa
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            torch.cat([xa, b])
        with pytest.raises(RuntimeError, match=SAME_DEVICE + r" \(when checking argument for aten::histogram(\.bins_tensor)?\)"):
            torch.histogram(xa.flatten(), torch.linspace(0, 1, 5))
        assert_same(xa * torch.tensor(2.0), a * 2.0)   # 0-d CPU tensors are still scalars
        assert_same(xa[torch.tensor([0, 2])], a[torch.tensor([0, 2])])   # as are CPU indices
    with env_vars.overlay({"XLA_CPU_OPERAND": "sometimes"}):
        with pytest.raises(ValueError, match="XLA_CPU_OPERAND='sometimes'"):
            xa + b
