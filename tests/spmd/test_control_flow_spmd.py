"""scan and assume_pure on sharded values: the values of eager CPU, the layouts XLA chose."""
from __future__ import annotations

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.assume_pure import assume_pure
from torch_xla.experimental.scan import scan


def _mesh():
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("model",))


def test_scan_over_sharded_values_keeps_their_layout():
    mesh, n = _mesh(), xr.global_runtime_device_count()

    def fn(carry, x):
        c = torch.sin(carry + x)
        return c, c * 2

    xs_cpu = torch.randn(5, 64)
    init = torch.zeros(64, device="xla", requires_grad=True)
    xs.mark_sharding(init, mesh, ("model",))
    xs_dev = xs_cpu.to("xla").requires_grad_()
    xs.mark_sharding(xs_dev, mesh, (None, "model"))
    carry, ys = scan(fn, init, xs_dev)
    (carry.sum() + ys.sum()).backward()
    torch_xla.sync()

    ci, cx = torch.zeros(64, requires_grad=True), xs_cpu.clone().requires_grad_()
    c, outs = ci, []
    for i in range(5):
        c, y = fn(c, cx[i])
        outs.append(y)
    (c.sum() + torch.stack(outs).sum()).backward()
    torch.testing.assert_close(carry.cpu(), c.detach())
    torch.testing.assert_close(ys.cpu(), torch.stack(outs).detach())
    torch.testing.assert_close(xs_dev.grad.cpu(), cx.grad)
    assert f"devices=[{n}]" in torch_xla._XLAC._get_xla_sharding_spec(carry)
    assert f"devices=[1,{n}]" in torch_xla._XLAC._get_xla_sharding_spec(ys)


def test_assume_pure_with_mark_sharding_inside():
    mesh, n = _mesh(), xr.global_runtime_device_count()
    x_cpu = torch.randn(8, 16)

    @assume_pure
    def f(x):
        y = torch.tanh(x) * 3
        xs.mark_sharding(y, mesh, ("model", None))
        return y

    y = f(x_cpu.to("xla"))
    torch_xla.sync()
    torch.testing.assert_close(y.cpu(), torch.tanh(x_cpu) * 3)
    assert f"devices=[{n},1]" in torch_xla._XLAC._get_xla_sharding_spec(y)
