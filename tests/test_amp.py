"""Automatic mixed precision: torch.autocast("xla"), GradScaler, syncfree optimizers.

Autocast dtypes are compared with eager CPU autocast(bfloat16) where CPU's policy agrees
with PyTorch/XLA's, and with PyTorch/XLA's policy where it does not (those cases also
check that the CPU differs, so the list stays honest). Training runs with an injected
inf are compared with eager CPU GradScaler runs: same skipped steps, losses, scales and
parameters, and no device-to-host transfer during the steps.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla.amp import GradScaler, autocast, syncfree

from helpers import XLA, assert_same, to_cpu, to_xla

BF, F32 = torch.bfloat16, torch.float32


def _r(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape))).to(dtype)


# (name, fn, args, dtype under PyTorch/XLA's policy, whether CPU autocast agrees)
CASES = [
    ("mm", torch.mm, (_r(4, 5), _r(5, 3)), BF, True),
    ("matmul", torch.matmul, (_r(2, 4, 5), _r(5, 3)), BF, True),
    ("bmm", torch.bmm, (_r(2, 4, 5), _r(2, 5, 3)), BF, True),
    ("addmm", torch.addmm, (_r(3), _r(4, 5), _r(5, 3)), BF, True),
    ("baddbmm", torch.baddbmm, (_r(2, 4, 3), _r(2, 4, 5), _r(2, 5, 3)), BF, True),
    ("linear", F.linear, (_r(4, 5), _r(3, 5), _r(3)), BF, True),
    ("conv2d", F.conv2d, (_r(1, 2, 6, 6), _r(3, 2, 3, 3)), BF, True),
    ("conv1d", F.conv1d, (_r(1, 2, 8), _r(3, 2, 3)), BF, True),
    ("einsum", lambda a, b: torch.einsum("ij,jk->ik", a, b), (_r(4, 5), _r(5, 3)), BF, True),
    ("prelu", F.prelu, (_r(2, 3, 4), _r(3)), BF, True),
    ("relu", torch.relu, (_r(4, 5),), BF, False),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), (_r(1, 2, 4, 4),), BF, False),
    ("softmax", lambda x: torch.softmax(x, -1), (_r(4, 5, dtype=BF),), F32, False),
    ("log_softmax", lambda x: torch.log_softmax(x, -1), (_r(4, 5, dtype=BF),), F32, False),
    ("pow", lambda x: x.pow(2), (_r(4, 5, dtype=BF),), F32, False),
    ("prod", torch.prod, (_r(4, dtype=BF),), F32, True),
    ("trace", torch.trace, (_r(4, 4, dtype=BF),), F32, True),
    ("mse_loss", F.mse_loss, (_r(4, 5, dtype=BF), _r(4, 5, dtype=BF, seed=1)), F32, True),
    ("l1_loss", F.l1_loss, (_r(4, 5, dtype=BF), _r(4, 5, dtype=BF, seed=1)), F32, True),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), (_r(4, 5, dtype=BF), torch.tensor([0, 2, 4, 1])), F32, True),
    ("nll_loss", lambda x, t: F.nll_loss(x, t), (_r(4, 5, dtype=BF), torch.tensor([0, 2, 4, 1])), F32, True),
    ("bce_logits", F.binary_cross_entropy_with_logits, (_r(4, 5, dtype=BF), _r(4, 5, dtype=BF).sigmoid()), F32, True),
    ("cat", lambda a, b: torch.cat([a, b]), (_r(2, 3, dtype=BF), _r(2, 3)), F32, True),
    ("stack", lambda a, b: torch.stack([a, b]), (_r(2, 3, dtype=BF), _r(2, 3)), F32, True),
    ("add (no policy)", torch.add, (_r(4, 5), _r(4, 5, seed=1)), F32, True),
    ("sum (no policy)", torch.sum, (_r(4, 5, dtype=BF),), BF, True),
    ("mm float64 (not cast)", torch.mm, (_r(4, 5).double(), _r(5, 3).double()), torch.float64, True),
]


@pytest.mark.parametrize("name,fn,args,expected,cpu_agrees", CASES, ids=[c[0] for c in CASES])
def test_autocast_op_dtype(name, fn, args, expected, cpu_agrees):
    with torch.autocast("cpu", dtype=BF):
        cpu = fn(*args)
    assert (cpu.dtype == expected) == cpu_agrees, f"CPU autocast gives {cpu.dtype}"
    with torch.autocast("xla", dtype=BF):
        got = fn(*to_xla(args))
    assert got.dtype == expected
    # Value: the CPU computing in the dtypes the policy names.
    if not cpu_agrees:
        cast = tuple(a.to(expected) if a.is_floating_point() and a.dtype != torch.float64 else a for a in args)
        cpu = fn(*cast)
    tol = dict(rtol=2e-2, atol=2e-2) if BF in (expected, *[a.dtype for a in args]) else {}
    assert_same(got, cpu, **tol)


def test_autocast_entry_points_and_backward():
    x = _r(4, 5)
    w = _r(3, 5, seed=2).requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        ref = torch.relu(F.linear(x, w)).float().sum()
    ref.backward()
    wx = to_xla(w)
    with autocast(XLA):  # torch_xla.amp.autocast: bfloat16 by default
        out = torch.relu(F.linear(to_xla(x), wx)).float().sum()
        assert torch.get_autocast_dtype("xla") == BF
    out.backward()
    assert wx.grad.dtype == F32
    assert_same(out, ref, rtol=1e-2, atol=1e-2)
    assert_same(wx.grad, w.grad, rtol=1e-2, atol=1e-2)
    with torch.autocast("xla", dtype=torch.float16):
        assert torch.mm(to_xla(x), to_xla(_r(5, 2))).dtype == torch.float16
    with torch.autocast("xla", enabled=False):
        assert torch.mm(to_xla(x), to_xla(_r(5, 2))).dtype == F32
    with pytest.raises(AssertionError):
        autocast("cpu")


def _transfers():
    d = met.metric_data("TransferFromDeviceTime")
    return d[0] if d else 0


_BAD = (2, 5)


def _train(dev, model, opt_fn, scaler, steps=8):
    torch.manual_seed(0)
    m = copy.deepcopy(model).to(dev)
    opt = opt_fn(m.parameters())
    losses, scales = [], []
    start = None
    for i in range(steps):
        x, y = _r(6, 4, seed=10 + i), _r(6, 2, seed=20 + i)
        if i in _BAD:
            x[0, 0] = float("inf")
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        with torch.autocast("cpu" if dev == "cpu" else "xla", dtype=BF):
            loss = F.mse_loss(m(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        scales.append(scaler._scale.detach().clone())
        if dev != "cpu":
            torch_xla.sync()
            if i == 1:
                start = _transfers()
    if dev != "cpu":
        assert _transfers() == start, "a training step read a value back to the host"
    return to_cpu(losses), to_cpu(scales), to_cpu(list(m.parameters()))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("kind", ["xla_scaler_sgd", "torch_scaler_adamw"])
def test_grad_scaler_skips_the_steps_eager_skips(kind):
    model = _model()
    if kind == "xla_scaler_sgd":
        ref_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
        opt = lambda p: syncfree.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
        scaler = GradScaler(growth_interval=2)
    else:
        ref_opt = lambda p: torch.optim.AdamW(p, lr=0.01)  # noqa: E731
        opt = lambda p: syncfree.AdamW(p, lr=0.01)  # noqa: E731
        scaler = torch.amp.GradScaler("xla", growth_interval=2)
    ref = _train("cpu", model, ref_opt, torch.amp.GradScaler("cpu", growth_interval=2))
    got = _train(XLA, model, opt, scaler)
    # The injected steps are the ones skipped: the scale backs off exactly there.
    backed_off = [i for i in range(1, len(ref[1])) if ref[1][i] < ref[1][i - 1]]
    assert backed_off == list(_BAD)
    assert_same(got[1], ref[1])
    assert_same(got[0], ref[0], rtol=1e-4, atol=1e-5, equal_nan=True)
    assert_same(got[2], ref[2], rtol=1e-4, atol=1e-5)


def test_grad_scaler_with_a_plain_optimizer():
    model = _model()
    ref = _train("cpu", model, lambda p: torch.optim.SGD(p, lr=0.1), torch.amp.GradScaler("cpu", growth_interval=3), 6)
    m = copy.deepcopy(model).to(XLA)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = GradScaler(growth_interval=3)
    for i in range(6):
        x, y = _r(6, 4, seed=10 + i), _r(6, 2, seed=20 + i)
        if i in _BAD:
            x[0, 0] = float("inf")
        opt.zero_grad()
        with autocast(XLA):
            loss = F.mse_loss(m(x.to(XLA)), y.to(XLA))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch_xla.sync()
    assert_same(scaler._scale, ref[1][-1])
    assert_same(list(m.parameters()), ref[2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,xla_cls,cpu_cls,kw", [
    ("sgd", syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)),
    ("sgd_nesterov", syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ("adam_amsgrad", syncfree.Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True)),
    ("adamw", syncfree.AdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
])
def test_syncfree_optimizer_matches_torch_optim(name, xla_cls, cpu_cls, kw):
    model = _model()
    ref_m, m = copy.deepcopy(model), copy.deepcopy(model).to(XLA)
    ref_opt, opt = cpu_cls(ref_m.parameters(), **kw), xla_cls(m.parameters(), **kw)
    found = [1.0, 0.0, 1.0, 0.0, 0.0]  # skipped first: the state starts at the first real step
    for i, f in enumerate(found):
        x, y = _r(6, 4, seed=30 + i), _r(6, 2, seed=40 + i)
        for mm, o, dev in ((ref_m, ref_opt, "cpu"), (m, opt, XLA)):
            o.zero_grad()
            F.mse_loss(mm(x.to(dev)), y.to(dev)).backward()
        if not f:
            ref_opt.step()
        opt.step(found_inf=torch.tensor(f, device=XLA))
        torch_xla.sync()
    assert_same(list(m.parameters()), list(ref_m.parameters()), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="scalar"):
        opt.step(found_inf=torch.zeros(2, device=XLA))
