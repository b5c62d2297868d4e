"""Writes into views made by `as_strided` over another view (PyTorch's functional storage
refuses them for every device but its own XLA type): the xla device does what eager
PyTorch does on the CPU, for the view, its base and the base's other views."""
from __future__ import annotations

import torch

import torch_xla
from helpers import assert_same


def _both(fn):
    cpu = fn(torch.device("cpu"))
    dev = fn(torch_xla.device())
    assert_same(dev, cpu)
    torch_xla.sync()
    assert_same(dev, cpu)


def test_setitem_in_as_strided_of_detach():
    def body(d):
        r = torch.arange(30, dtype=torch.int32).to(d).detach()
        a = torch.as_strided(r, (5, 2, 3), (1, 15, 5))
        other = r[10:14]
        a[1, 0, 2] = -1
        return a, r, other
    _both(body)


def test_slice_assign_in_as_strided_of_slice():
    def body(d):
        base = torch.arange(12.).to(d)
        s = base[2:]
        w = torch.as_strided(s, (3, 2), (2, 1))
        w[1:, 0] = torch.tensor([100., 200.]).to(d)
        return w, s, base
    _both(body)


def test_copy_broadcast_into_as_strided_of_view():
    def body(d):
        x = torch.zeros(4, 6).to(d)
        v = x.view(24)
        w = torch.as_strided(v, (2, 3), (6, 2), 1)
        w.copy_(torch.tensor([1., 2., 3.]).to(d))
        return w, x
    _both(body)

