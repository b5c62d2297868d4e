"""scan, scan_layers, while_loop / fori_loop and assume_pure against eager PyTorch on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.debug.metrics as met
from functorch.compile import min_cut_rematerialization_partition
from torch._higher_order_ops.while_loop import while_loop
from torch_xla.experimental.assume_pure import PureModule, assume_pure
from torch_xla.experimental.fori_loop import fori_loop
from torch_xla.experimental.scan import scan
from torch_xla.experimental.scan_layers import scan_layers

DEV = torch_xla.device()


def _loop(fn, init, xs):
    carry, ys = init, []
    for i in range(xs.shape[0]):
        carry, y = fn(carry, xs[i])
        ys.append(y)
    return carry, torch.stack(ys)


def _step(carry, x):
    h = torch.tanh(carry @ x + 0.5)
    return h, h.sum(0) * 2


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_scan_values_and_gradients_equal_eager_cpu(partition):
    torch.manual_seed(0)
    init, xs = torch.randn(3, 4), torch.randn(5, 4, 4)
    ci, cx = init.clone().requires_grad_(), xs.clone().requires_grad_()
    carry, ys = _loop(_step, ci, cx)
    (carry.sum() + (ys * ys).sum()).backward()

    di, dx = init.to(DEV).requires_grad_(), xs.to(DEV).requires_grad_()
    kw = {"partition_fn": min_cut_rematerialization_partition} if partition == "min_cut" else {}
    dcarry, dys = scan(_step, di, dx, **kw)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([dys])
    assert "while(" in hlo
    (dcarry.sum() + (dys * dys).sum()).backward()
    torch_xla.sync()
    torch.testing.assert_close(dcarry.cpu(), carry.detach())
    torch.testing.assert_close(dys.cpu(), ys.detach())
    torch.testing.assert_close(di.grad.cpu(), ci.grad)
    torch.testing.assert_close(dx.grad.cpu(), cx.grad)


def test_scan_pytrees_none_outputs_and_mixed_dtypes():
    def fn(carry, x):
        a, n = carry["a"], carry["n"]
        return {"a": a * x["w"] + x["b"].float(), "n": n + 1}, (None, (a.sum(),))

    init = {"a": torch.ones(3), "n": torch.tensor(0)}
    xs = {"w": torch.linspace(0.5, 1.5, 12).reshape(4, 3), "b": torch.arange(12).reshape(4, 3)}
    carry, ys = scan(fn, {k: v.to(DEV) for k, v in init.items()}, {k: v.to(DEV) for k, v in xs.items()})
    exp_carry, exp_ys = init, []
    for i in range(4):
        exp_carry, y = fn(exp_carry, {k: v[i] for k, v in xs.items()})
        exp_ys.append(y[1][0])
    assert ys[0] is None
    torch.testing.assert_close(carry["a"].cpu(), exp_carry["a"])
    assert carry["n"].dtype == torch.int64 and int(carry["n"].cpu()) == 4
    torch.testing.assert_close(ys[1][0].cpu(), torch.stack(exp_ys))


def test_scan_does_not_recompile_after_the_first_step():
    def fn(c, x):
        return c + torch.sin(x), c * 2

    xs = torch.randn(7, 3, device=DEV)
    init = torch.zeros(3, device=DEV)
    torch_xla.sync()
    c, ys = scan(fn, init, xs)   # trace and compile
    torch_xla.sync()
    met.clear_all()
    for _ in range(3):
        c, ys = scan(fn, init, xs)
        torch_xla.sync()
    assert met.counter_value("UncachedCompile") in (None, 0)
    torch.testing.assert_close(c.cpu(), torch.sin(xs.cpu()).sum(0))


def test_scan_random_numbers_differ_between_iterations():
    def fn(c, x):
        return c + x, torch.rand(4, device=DEV)

    _, ys = scan(fn, torch.zeros(4, device=DEV), torch.zeros(3, 4, device=DEV))
    ys = ys.cpu()
    assert not torch.equal(ys[0], ys[1]) and not torch.equal(ys[1], ys[2])
    assert ((ys >= 0) & (ys < 1)).all()


def test_scan_errors():
    init, xs = torch.zeros(2, device=DEV), torch.zeros(3, 2, device=DEV)
    with pytest.raises(ValueError, match="callable"):
        scan(3, init, xs)
    with pytest.raises(ValueError, match="leading dimension"):
        scan(lambda c, x: (c, x), init, (xs, torch.zeros(2, 2, device=DEV)))
    with pytest.raises(ValueError, match="same shapes"):
        scan(lambda c, x: (torch.cat([c, x]), x), init, xs, is_fn_pure=False)
    with pytest.raises(ValueError, match="same structure"):
        scan(lambda c, x: ((c, c), x), init, xs, is_fn_pure=False)


def test_scan_layers_matches_the_loop_and_fills_each_layers_grad():
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(4)])
    x = torch.randn(2, 8)
    cpu = copy.deepcopy(layers)
    out = x
    for layer in cpu:
        out = layer(out)
    out.pow(2).sum().backward()

    dev_layers = copy.deepcopy(layers).to(DEV)
    dout = scan_layers(dev_layers, x.to(DEV), is_layer_pure=True)
    dout.pow(2).sum().backward()
    torch_xla.sync()
    torch.testing.assert_close(dout.cpu(), out.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(dev_layers.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-5)


def test_scan_layers_refuses_layers_of_different_structure():
    with pytest.raises(ValueError, match="mismatched keys"):
        scan_layers([nn.Linear(4, 4).to(DEV), nn.Sequential(nn.Linear(4, 4)).to(DEV)], torch.zeros(4, device=DEV))
    with pytest.raises(ValueError, match="Shape mismatch"):
        scan_layers([nn.Linear(4, 4).to(DEV), nn.Linear(4, 5).to(DEV)], torch.zeros(4, device=DEV))


def test_while_loop_is_one_device_loop():
    def cond(i, x):
        return i < 10

    def body(i, x):
        return i + 1, x * 1.5 + i.float()

    i0, x0 = torch.tensor(0), torch.ones(3)
    ci, cx = i0, x0
    while cond(ci, cx):
        ci, cx = body(ci, cx)
    met.clear_all()
    di, dx = while_loop(cond, body, (i0.to(DEV), x0.to(DEV)))
    assert "while(" in torch_xla._XLAC._get_xla_tensors_hlo([dx])
    torch_xla.sync()
    assert met.metric_data("TransferFromDeviceTime") is None   # no host read of the condition
    assert int(di.cpu()) == int(ci)
    torch.testing.assert_close(dx.cpu(), cx)


def test_fori_loop():
    _, out = fori_loop(0, 5, lambda v: v * 2 + 1, torch.ones(2, device=DEV))
    torch.testing.assert_close(out.cpu(), torch.full((2,), 63.0))


def test_assume_pure_traces_once_and_gives_eager_values_and_gradients():
    calls = []

    @assume_pure
    def f(a, b, *, scale):
        calls.append(1)
        return torch.sin(a @ b) * scale, {"s": (a * b).sum()}

    torch.manual_seed(0)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    o, d = torch.sin(ca @ cb) * 2.0, (ca * cb).sum()
    (o.sum() + d).backward()
    for _ in range(3):
        da, db = a.to(DEV).requires_grad_(), b.to(DEV).requires_grad_()
        out, aux = f(da, db, scale=2.0)
        (out.sum() + aux["s"]).backward()
        torch_xla.sync()
    assert len(calls) == 1
    torch.testing.assert_close(out.cpu(), o.detach())
    torch.testing.assert_close(da.grad.cpu(), ca.grad)
    torch.testing.assert_close(db.grad.cpu(), cb.grad)
    f(da, db, scale=3.0)   # another static value: traced again
    assert len(calls) == 2


def test_assume_pure_random_numbers_follow_the_seed():
    g = assume_pure(lambda a: a + torch.rand_like(a), add_rng_seed_argument=True)
    a = torch.zeros(4, device=DEV)
    r0, r1, r0b = g(a, rng_seed=0).cpu(), g(a, rng_seed=1).cpu(), g(a, rng_seed=0).cpu()
    assert torch.equal(r0, r0b) and not torch.equal(r0, r1)


def test_pure_module_equals_the_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5), nn.ReLU())
    x = torch.randn(2, 5)
    pm = PureModule(copy.deepcopy(m).to(DEV))
    torch.testing.assert_close(pm(x.to(DEV)).cpu(), m(x).detach(), rtol=1e-5, atol=1e-5)
