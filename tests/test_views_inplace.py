"""Views and in-place ops on xla tensors: every sequence is also run in eager PyTorch on the CPU.

Each test body is a function of the device; it builds its inputs on the CPU, moves them
with `.to(device)`, runs the same sequence of views / in-place writes, and returns the
tensors to compare. `_barrier(dev)` is `xm.mark_step()` on the device and a no-op on the CPU,
and results are compared both before (via the host read, which forces execution) and after
the barrier.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torch_xla  # noqa: F401  (registers the xla device)
import torch_xla.core.xla_model as xm

CPU = torch.device("cpu")


def _xla():
    return xm.xla_device()


def _barrier(dev):
    if dev.type == "xla":
        xm.mark_step()


def _cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _both(fn, rtol=1.3e-6, atol=1e-5):
    """Runs fn(device) on the CPU and on the xla device and compares the returned trees."""
    cres = fn(CPU)
    xres = fn(_xla())
    torch.testing.assert_close(_cpu(xres), _cpu(cres), rtol=rtol, atol=atol)
    return xres, cres


def _base(dev, shape=(4, 5), start=0.0):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) + start).reshape(shape).to(dev)


# ---------------------------------------------------------------------------------------
# setitem

def test_setitem_row():
    def f(dev):
        x = _base(dev)
        x[0] = torch.tensor([10.0, 11, 12, 13, 14]).to(dev)
        x[2] = 7.5
        _barrier(dev)
        return x
    _both(f)


def test_setitem_column():
    def f(dev):
        x = _base(dev)
        x[:, 0] = torch.tensor([-1.0, -2, -3, -4]).to(dev)
        x[:, -1] = 0.25
        return x
    _both(f)


def test_setitem_index_tensor():
    def f(dev):
        x = _base(dev)
        idx = torch.tensor([3, 0]).to(dev)
        x[idx] = torch.full((2, 5), 9.0).to(dev)
        y = _base(dev, (6,))
        y[torch.tensor([1, 4, 5]).to(dev)] = -1.0
        _barrier(dev)
        return x, y
    _both(f)


def test_setitem_slice_iadd():
    def f(dev):
        x = _base(dev)
        x[1:3] += 1
        x[:, 1:4:2] *= 2
        _barrier(dev)
        x[1:3] += 1
        return x
    _both(f)


def test_setitem_before_and_after_barrier_values():
    """A host read in the middle (forced execution) then more writes."""
    def f(dev):
        x = _base(dev)
        x[0] = 1.0
        first = x.sum().item()
        x[1] = 2.0
        _barrier(dev)
        return torch.tensor(first), x
    _both(f)


# ---------------------------------------------------------------------------------------
# views of parameters, .data writes

def test_parameter_view_write_reaches_parameter():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        with torch.no_grad():
            p.view(-1)[0] = 5.0
            p.view(3, 2)[2, 1] = -5.0
        assert isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad
        _barrier(dev)
        return p
    _both(f)


def test_data_mul_():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        p.data.mul_(2)
        assert p.requires_grad and p.is_leaf
        (p * p).sum().backward()
        _barrier(dev)
        return p, p.grad
    _both(f)


def test_data_assign_new_tensor():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        ident = id(p)
        p.data = _base(dev, (2, 3), start=100.0)
        assert id(p) == ident and p.requires_grad
        (3 * p).sum().backward()
        _barrier(dev)
        return p, p.grad
    _both(f)


def test_data_assign_new_shape():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        p.data = _base(dev, (4,), start=1.0)
        assert p.shape == (4,)
        (p * 2).sum().backward()
        return p, p.grad
    _both(f)


def test_write_through_data_view():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        p.data.view(-1)[4] = 42.0
        p.data.view(3, 2)[0].fill_(-1.0)
        _barrier(dev)
        return p
    _both(f)


# ---------------------------------------------------------------------------------------
# writes through transpose / reshape / narrow reach their base

def test_transpose_write_reaches_base():
    def f(dev):
        x = _base(dev, (3, 4))
        t = x.t()
        t[1, 2] = 100.0
        t.mul_(2)
        x.transpose(0, 1)[0].add_(1)
        return x, t
    _both(f)


def test_reshape_view_write_reaches_base():
    def f(dev):
        x = _base(dev, (3, 4))
        r = x.reshape(12)   # contiguous: a view
        r[5] = -3.0
        r.add_(0.5)
        return x, r
    _both(f)


def test_narrow_write_reaches_base():
    def f(dev):
        x = _base(dev, (3, 4))
        n = x.narrow(1, 1, 2)
        n.fill_(7.0)
        x.narrow(0, 2, 1).mul_(-1)
        _barrier(dev)
        return x, n
    _both(f)


def test_inplace_on_view_of_view():
    def f(dev):
        x = _base(dev, (4, 6))
        v = x.view(2, 12)[1]            # view of view
        w = v.narrow(0, 3, 5)            # view of view of view
        w.mul_(10)
        x[0].view(3, 2).t()[1].sub_(1)  # t() of view of select
        _barrier(dev)
        return x, v, w
    _both(f)


def test_base_write_seen_by_view():
    def f(dev):
        x = _base(dev, (3, 4))
        v = x[1]
        x.add_(1)
        x[1, 2] = 0.0
        return v, x
    _both(f)


def test_chained_inplace_before_one_barrier():
    def f(dev):
        x = _base(dev, (3, 4))
        y = _base(dev, (3, 4), start=-5.0)
        x.add_(1).mul_(2).sub_(y)
        x.clamp_(min=3.0, max=20.0)
        x.div_(y.abs() + 1).neg_()
        x[0].zero_()
        y.copy_(x)
        y.unsqueeze_(0)
        _barrier(dev)
        return x, y
    _both(f)


# ---------------------------------------------------------------------------------------
# gradients

def test_grad_mul_and_zero():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        (p * p).sum().backward()
        g0 = p.grad.clone()
        p.grad.mul_(0.5)
        g1 = p.grad.clone()
        (p * 3).sum().backward()           # accumulates into the scaled grad
        g2 = p.grad.clone()
        p.grad.zero_()
        g3 = p.grad.clone()
        (p.sum() * 2).backward()
        _barrier(dev)
        return g0, g1, g2, g3, p.grad
    _both(f)


def test_no_grad_update():
    def f(dev):
        p = nn.Parameter(_base(dev, (2, 3)))
        for _ in range(3):
            loss = (p * p).sum()
            loss.backward()
            with torch.no_grad():
                p -= 0.1 * p.grad
                p.grad.zero_()
            assert p.is_leaf and p.requires_grad and p.grad_fn is None
            _barrier(dev)
        return p
    _both(f)


def test_python_attribute_survives_saved_for_backward():
    def f(dev):
        x = _base(dev, (2, 3)).requires_grad_()
        x.foo = 1
        y = (x * 2).sum()
        z = (x * x).sum()          # saves x itself for backward
        (y + z).backward()
        assert x.foo == 1
        _barrier(dev)
        assert x.foo == 1
        w = x.exp()                # exp saves its output
        w.bar = "b"
        w.sum().backward()
        assert w.bar == "b" and x.foo == 1
        return x.grad
    _both(f)


# ---------------------------------------------------------------------------------------
# tied weights

class _TiedLM(nn.Module):
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.proj(self.emb(idx))))


def test_tied_weights_training():
    """Gradients accumulate from both uses of the shared weight; optimizer steps keep it tied.

    The model is re-tied after `.to(dev)` (a no-op on the CPU) so that this test checks the
    training path independently of `test_tied_weights_still_tied_after_to_device`.
    """
    torch.manual_seed(0)
    base = _TiedLM()
    tok = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1]])
    tgt = torch.tensor([[2, 3, 4, 5], [6, 7, 1, 2]])

    def f(dev):
        m = copy.deepcopy(base).to(dev)
        m.head.weight = m.emb.weight
        assert len(list(m.parameters())) == 3  # emb/head weight once, proj weight+bias
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        grads = []
        for _ in range(3):
            opt.zero_grad()
            logits = m(tok.to(dev))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.to(dev).reshape(-1))
            loss.backward()
            grads.append(m.emb.weight.grad.clone())
            opt.step()
            _barrier(dev)
            assert m.head.weight is m.emb.weight
        return grads, m.emb.weight, m.head.weight, m.proj.weight

    (xg, xe, xh, _), _ = _both(f, rtol=1e-5, atol=1e-5)

    # the gradient of the shared weight is the sum of the contributions of both uses
    m = copy.deepcopy(base).to(_xla())
    m.head.weight = m.emb.weight
    logits = m(tok.to(_xla()))
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.to(_xla()).reshape(-1))
    loss.backward()
    cm = copy.deepcopy(base)
    cm.head.weight = nn.Parameter(cm.emb.weight.detach().clone())  # untie on the CPU
    cl = cm(tok)
    nn.functional.cross_entropy(cl.reshape(-1, cl.shape[-1]), tgt.reshape(-1)).backward()
    torch.testing.assert_close(m.emb.weight.grad.cpu(), cm.emb.weight.grad + cm.head.weight.grad,
                               rtol=1e-5, atol=1e-6)


def test_tied_weights_still_tied_after_to_device():
    m = _TiedLM().to(_xla())
    assert m.head.weight is m.emb.weight
    assert len(list(m.parameters())) == 3
    assert isinstance(m.head.weight, nn.Parameter)
    with torch.no_grad():
        m.emb.weight[0, 0] = 123.0
    xm.mark_step()
    assert m.head.weight[0, 0].item() == 123.0


# ---------------------------------------------------------------------------------------
# copies

def test_deepcopy_is_independent():
    x = _base(_xla(), (2, 3))
    x.add_(1)                       # pending IR when copied
    d = copy.deepcopy(x)
    x.mul_(10)
    xm.mark_step()
    assert d.device == x.device
    torch.testing.assert_close(d.cpu(), _base(CPU, (2, 3)) + 1)
    torch.testing.assert_close(x.cpu(), (_base(CPU, (2, 3)) + 1) * 10)
    d.sub_(100)
    torch.testing.assert_close(x.cpu(), (_base(CPU, (2, 3)) + 1) * 10)


def test_copy_copy_is_independent():
    """As upstream torch_xla: copy.copy of an xla tensor is a deep copy (on the CPU it shares storage)."""
    x = _base(_xla(), (2, 3))
    c = copy.copy(x)
    x.add_(5)
    xm.mark_step()
    assert c.device == x.device and c.shape == x.shape and c.dtype == x.dtype
    torch.testing.assert_close(c.cpu(), _base(CPU, (2, 3)))
    c.mul_(2)
    torch.testing.assert_close(x.cpu(), _base(CPU, (2, 3)) + 5)


def test_deepcopy_parameter_and_module():
    p = nn.Parameter(_base(_xla(), (2, 3)))
    q = copy.deepcopy(p)
    assert isinstance(q, nn.Parameter) and q.requires_grad and q.device == p.device
    with torch.no_grad():
        p.add_(1)
    torch.testing.assert_close(q.detach().cpu(), _base(CPU, (2, 3)))
    lin = nn.Linear(3, 2).to(_xla())
    lin2 = copy.deepcopy(lin)
    with torch.no_grad():
        lin.weight.zero_()
    assert lin2.weight.abs().sum().item() > 0


def test_clone_independent():
    def f(dev):
        x = _base(dev, (2, 3))
        c = x.clone()
        x.add_(1)
        c.mul_(3)
        return x, c
    _both(f)


def test_detach_shares_value():
    def f(dev):
        x = _base(dev, (2, 3)).requires_grad_()
        with torch.no_grad():
            x.mul_(1)
        d = x.detach()
        assert not d.requires_grad
        d.add_(1)                   # visible through x
        _barrier(dev)
        with torch.no_grad():
            x[0, 0] = -7.0          # visible through d
        return x, d
    _both(f)


# ---------------------------------------------------------------------------------------
# requires_grad flags and state dicts

def test_requires_grad_preserved_by_to():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    m[2].bias.requires_grad_(False)
    xm_ = copy.deepcopy(m).to(_xla())
    for (n, p), (_, q) in zip(m.named_parameters(), xm_.named_parameters()):
        assert q.device.type == "xla"
        assert isinstance(q, nn.Parameter), n
        assert q.requires_grad == p.requires_grad, n
        assert q.is_leaf, n
    for (n, b), (_, c) in zip(m.named_buffers(), xm_.named_buffers()):
        assert not c.requires_grad and c.dtype == b.dtype, n

    t = torch.randn(3, requires_grad=True)
    for dev in (_xla(),):
        u = t.to(dev)
        assert u.requires_grad and not u.is_leaf and u.grad_fn is not None
        (u * 2).sum().backward()
        torch.testing.assert_close(t.grad, torch.full((3,), 2.0))
        v = t.detach().to(dev).requires_grad_()
        assert v.is_leaf and v.requires_grad


def _sd_model():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))


def _trained_cpu_model():
    torch.manual_seed(0)
    cpu = _sd_model()
    cpu.train()
    cpu(torch.randn(4, 2, 4, 4))    # update the running stats
    return cpu


def test_state_dict_cpu_to_xla():
    cpu = _trained_cpu_model()
    torch.manual_seed(1)
    xla = _sd_model().to(_xla())
    params_before = [id(p) for p in xla.parameters()]
    xla.load_state_dict(cpu.state_dict())
    assert [id(p) for p in xla.parameters()] == params_before
    assert all(p.requires_grad and p.device.type == "xla" for p in xla.parameters())
    xsd = xla.state_dict()
    for k, v in cpu.state_dict().items():
        assert xsd[k].device.type == "xla", k
        assert xsd[k].dtype == v.dtype, k
        torch.testing.assert_close(xsd[k].cpu(), v, rtol=0, atol=0)
    x = torch.randn(4, 2, 4, 4)
    cpu.eval()
    xla.eval()
    torch.testing.assert_close(xla(x.to(_xla())).detach().cpu(), cpu(x).detach(), rtol=1e-5, atol=1e-5)


def test_state_dict_xla_to_cpu():
    cpu = _trained_cpu_model()
    xla = copy.deepcopy(cpu).to(_xla())
    # change on the device, bring back to a fresh CPU model
    with torch.no_grad():
        for p in xla.parameters():
            p.mul_(2)
    xla[1].num_batches_tracked += 5
    back = _sd_model()
    back.load_state_dict(xla.state_dict())
    for k, v in cpu.state_dict().items():
        w = back.state_dict()[k]
        assert w.device.type == "cpu"
        if k.endswith(("weight", "bias")):
            torch.testing.assert_close(w, v * 2, rtol=0, atol=0)
        elif k.endswith("num_batches_tracked"):
            assert w.item() == v.item() + 5
        else:
            torch.testing.assert_close(w, v, rtol=0, atol=0)
    x = torch.randn(4, 2, 4, 4)
    back.eval()
    xla.eval()
    torch.testing.assert_close(xla(x.to(_xla())).detach().cpu(), back(x).detach(), rtol=1e-5, atol=1e-5)


def test_state_dict_xla_to_cpu_via_cpu_copies():
    """The same round trip, with the state dict moved to the CPU first (as xm.save does)."""
    cpu = _trained_cpu_model()
    xla = copy.deepcopy(cpu).to(_xla())
    with torch.no_grad():
        for p in xla.parameters():
            p.mul_(2)
    back = _sd_model()
    back.load_state_dict({k: v.cpu() for k, v in xla.state_dict().items()})
    for k, v in cpu.state_dict().items():
        w = back.state_dict()[k]
        want = v * 2 if k.endswith(("weight", "bias")) else v
        torch.testing.assert_close(w, want, rtol=0, atol=0)


def test_replace_xla_tensor_takes_the_source_value():
    """`_XLAC._replace_xla_tensor(t, s)` is `t.set_(s.clone())` outside autograd, as on the
    CPU: `t` (a parameter too) takes `s`'s shape and value, later writes stay apart, and a
    different dtype is refused with set_'s RuntimeError."""
    def run(dev):
        out = []
        t = torch.arange(6.0).reshape(2, 3).to(dev)
        t += 1
        _barrier(dev)
        s = torch.linspace(0, 1, 4).to(dev)
        if dev.type == "xla":
            r = torch_xla._XLAC._replace_xla_tensor(t, s)
        else:
            with torch.no_grad():
                r = t.set_(s.clone())
        assert r is t
        t += 1
        out += [t, s]
        p = nn.Parameter(torch.ones(4, 3).to(dev))
        for src in (torch.zeros(1), torch.full((2, 2), 3.0)):
            if dev.type == "xla":
                torch_xla._XLAC._replace_xla_tensor(p, src.to(dev))
            else:
                with torch.no_grad():
                    p.set_(src.clone())
        assert isinstance(p, nn.Parameter) and p.requires_grad
        (p * torch.arange(4.0).reshape(2, 2).to(dev)).sum().backward()
        out += [p.detach(), p.grad]
        return [o.cpu() for o in out]

    for got, want in zip(run(_xla()), run(CPU)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    x = torch.zeros(2, device=_xla())
    with pytest.raises(RuntimeError):
        torch.zeros(2).set_(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError):
        torch_xla._XLAC._replace_xla_tensor(x, torch.zeros(2, dtype=torch.int64, device=_xla()))


def test_reading_views_of_device_data_runs_no_program():
    """`row.cpu()` for each row of a device tensor: the values of the CPU's views, and no
    program compiled per row index (the base's host copy is sliced on the host)."""
    import torch_xla.debug.metrics as met
    c = torch.arange(24.).reshape(4, 6)
    x = c.to("xla")
    torch_xla.sync()
    met.clear_all()
    for i in range(4):
        torch.testing.assert_close(x[i].cpu(), c[i])
    torch.testing.assert_close(x[:, 1:5:2].cpu(), c[:, 1:5:2])
    torch.testing.assert_close(x.t()[2].cpu(), c.t()[2])
    torch.testing.assert_close(x.view(6, 4)[1:3].cpu(), c.view(6, 4)[1:3])
    torch.testing.assert_close(x.expand((1, 1, -1, -1))[0, 0].cpu(), c)
    for row, crow in zip(x, c):   # iteration: unbind
        torch.testing.assert_close(row.cpu(), crow)
    assert met.counter_value("UncachedCompile") in (None, 0)
    assert met.counter_value("ExecuteCount") in (None, 0)
    y = x * 2   # a pending value is computed by a program as before
    torch.testing.assert_close(y[1].cpu(), c[1] * 2)
