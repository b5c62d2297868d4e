"""Ops whose generic PyTorch kernels write through views (so they need direct lowerings)."""
import torch
import torch_xla.debug.metrics as met

from helpers import check_op


def _no_fallback():
    return [c for c in met.counter_names() if c.startswith("aten::") and c != "aten::_local_scalar_dense"]


def test_block_diag_complex_polar_mvlgamma_sign():
    met.clear_all()
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0, 7.0]])
    check_op(lambda x, y, z: torch.block_diag(x, y, z), a, b, torch.tensor(3.0), grad=True)
    x, y = torch.randn(5), torch.randn(5)
    check_op(torch.complex, x, y)
    check_op(torch.polar, x.abs(), y)
    check_op(lambda t: torch.mvlgamma(t, 3), torch.rand(4) + 3, grad=True, rtol=1e-5)
    check_op(torch.sign, torch.tensor([True, False]))
    check_op(torch.sgn, torch.tensor([1 + 1j, 0j, -2 + 0.5j]))
    assert _no_fallback() == []
