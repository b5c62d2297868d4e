"""Comparison helpers: every device result is checked against eager PyTorch on the CPU."""
from __future__ import annotations

import contextlib

import torch

import torch_xla
import torch_xla.debug.metrics as met

XLA = torch.device("xla", 0)


def to_xla(tree):
    if isinstance(tree, torch.Tensor):
        t = tree.detach().to(XLA)
        return t.requires_grad_(tree.requires_grad) if tree.is_floating_point() else t
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_xla(x) for x in tree)
    if isinstance(tree, dict):
        return {k: to_xla(v) for k, v in tree.items()}
    return tree


def to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu() if tree.device.type == "xla" else tree.detach()
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(x) for x in tree)
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    return tree


def assert_same(xla_result, cpu_result, rtol=1.3e-6, atol=1e-5, **kw):
    """The device result equals the CPU result (values, dtypes, shapes)."""
    torch.testing.assert_close(to_cpu(xla_result), to_cpu(cpu_result), rtol=rtol, atol=atol, **kw)


def check_op(fn, *args, rtol=1.3e-6, atol=1e-5, grad=False, **kwargs):
    """Runs fn on CPU tensors and on their xla copies and compares outputs (and grads)."""
    cargs = [a.detach().clone().requires_grad_(grad and a.is_floating_point())
             if isinstance(a, torch.Tensor) else a for a in args]
    xargs = [to_xla(a) if isinstance(a, torch.Tensor) else a for a in cargs]
    if grad:
        xargs = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in xargs]
    cout = fn(*cargs, **kwargs)
    xout = fn(*xargs, **kwargs)
    assert_same(xout, cout, rtol=rtol, atol=atol)
    if grad:
        couts = [o for o in (cout if isinstance(cout, (list, tuple)) else [cout]) if o.requires_grad]
        xouts = [o for o in (xout if isinstance(xout, (list, tuple)) else [xout]) if o.requires_grad]
        cin = [a for a in cargs if isinstance(a, torch.Tensor) and a.requires_grad]
        xin = [a for a in xargs if isinstance(a, torch.Tensor) and a.requires_grad]
        gs = [torch.ones_like(o) * 0.5 + torch.arange(o.numel()).reshape(o.shape).to(o.dtype) / max(o.numel(), 1)
              for o in couts]
        cg = torch.autograd.grad(couts, cin, gs, allow_unused=True)
        xg = torch.autograd.grad(xouts, xin, [g.to(XLA) for g in gs], allow_unused=True)
        for a, b in zip(xg, cg):
            if b is None:
                assert a is None
            else:
                assert_same(a, b, rtol=rtol * 10, atol=atol * 10)
    return xout, cout


@contextlib.contextmanager
def no_fallback(allow=()):
    """Asserts that nothing inside ran on the CPU fallback (except the ops in `allow`)."""
    met.clear_all()
    yield
    bad = [c for c in met.counter_names()
           if c.startswith("aten::") and c != "aten::_local_scalar_dense" and c not in allow]
    assert not bad, f"CPU fallback: {bad}"


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flat(o)]


def check_flat(fn, *args, grad=False, allow=None, others=(), rtol=1.3e-6, atol=1e-5):
    """Like `check_op`, for nested outputs: runs fn on CPU tensors and on xla copies and
    compares the flattened outputs (NaNs compare equal) and, with grad=True, the gradients
    of the float inputs. Asserts no CPU fallback (`allow`; with grad and no `allow`, the
    ops in `others`, which other families lower). All device results come from one graph."""
    with no_fallback(others if (grad and allow is None) else (allow or ())):
        cargs = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args]
        xargs = [a.detach().to(XLA).requires_grad_(grad and a.is_floating_point()) for a in args]
        cout = flat(fn(*cargs))
        xout = flat(fn(*xargs))
        xg = cg = []
        if grad:
            cdiff = [i for i, o in enumerate(cout) if o.requires_grad]
            gs = [(torch.arange(cout[i].numel()).reshape(cout[i].shape) % 7 * 0.25 + 0.5).to(cout[i].dtype)
                  for i in cdiff]
            cin = [a for a in cargs if a.requires_grad]
            xin = [a for a in xargs if a.requires_grad]
            cg = torch.autograd.grad([cout[i] for i in cdiff], cin, gs, allow_unused=True)
            xg = torch.autograd.grad([xout[i] for i in cdiff], xin, [g.to(XLA) for g in gs], allow_unused=True)
        torch_xla.sync()
        # Read back without .detach() on the device (a detach there is one more graph).
        xout = [t.cpu().detach() for t in xout]
        xg = [None if t is None else t.cpu() for t in xg]
        assert_same(xout, cout, rtol=rtol, atol=atol, equal_nan=True)
        for a, b in zip(xg, cg):
            assert (a is None) == (b is None)
            if b is not None:
                assert_same(a, b, rtol=rtol * 10, atol=atol * 10, equal_nan=True)
        return xout, cout
