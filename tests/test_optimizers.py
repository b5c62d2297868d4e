"""torch.optim on the xla device (foreach=True, the default there) against the CPU."""
import copy

import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met

from helpers import XLA, assert_same, to_cpu

ALLOWED = ("aten::_local_scalar_dense",)


def _fallbacks():
    return [c for c in met.counter_names() if c.startswith("aten::") and c not in ALLOWED]


def _compiles():
    d = met.metric_data("CompileTime")
    return d[0] if d else 0


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(10)]


def _train(model, make_opt, device, data, sched=False, clip=None):
    model = copy.deepcopy(model).to(device)
    opt = make_opt(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    losses, step_fallbacks, compiles, norms = [], [], [], []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if device != "cpu":
            torch_xla.sync()
            met.clear_counters()  # fallbacks of the optimizer step only (fwd/bwd ops are not ours)
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if device != "cpu":
            torch_xla.sync()
            step_fallbacks.append(_fallbacks())
            compiles.append(_compiles())
        losses.append(loss.detach().to("cpu").item())
    return model, losses, step_fallbacks, compiles, [to_cpu(n) for n in norms]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True, weight_decay=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=0.01),
}


def _check(name, sched=False, clip=None):
    met.clear_all()
    model, data = _model(), _data()
    make = OPTIMIZERS[name]
    cm, closs, _, _, cnorms = _train(model, lambda p: make(p), "cpu", data, sched, clip)
    xm_, xloss, fb, comp, xnorms = _train(model, lambda p: make(p), XLA, data, sched, clip)
    torch.testing.assert_close(xloss, closs, rtol=1e-5, atol=1e-6)
    for (n, a), (_, b) in zip(xm_.named_parameters(), cm.named_parameters()):
        assert_same(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} param {n}: {m}")
    for a, b in zip(xnorms, cnorms):
        assert_same(a, b, rtol=1e-5, atol=1e-6)
    assert all(not f for f in fb), f"CPU fallbacks in the {name} step: {fb}"
    # StepLR changes lr: a parameter, not a constant, so the step programs are reused:
    # after the first two steps, no compilation.
    assert comp[2:] == [comp[1]] * (len(comp) - 2), f"{name} recompiled: CompileTime samples per step {comp}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_cpu(name):
    _check(name, sched=True)


def test_clip_grad_norm_matches_cpu():
    _check("sgd", clip=0.5)


def test_clip_grad_norm_without_gradients_is_zero_on_the_device():
    """No parameter has a gradient: the norm is the CPU's zero, on the parameters' device
    (a tensor, a list, a generator); CPU parameters keep PyTorch's CPU zero."""
    g = torch.Generator().manual_seed(4)
    cps = [torch.randn(3, 2, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()]
    xps = [p.detach().to(XLA).requires_grad_() for p in cps]
    cpu_norm = torch.nn.utils.clip_grad_norm_(cps, 1.0)
    assert cpu_norm.device.type == "cpu"
    for arg in (xps, xps[0], (p for p in xps), iter(xps)):
        n = torch.nn.utils.clip_grad_norm_(arg, 1.0)
        assert n.device.type == "xla"
        assert_same(n, cpu_norm)
    with pytest.warns(UserWarning, match="empty generator"):
        n = torch.nn.utils.clip_grad_norm_((p for p in ()), 1.0)
    assert n.device.type == "cpu"
    # one of them with a gradient: PyTorch's own result, already on the device
    cps[1].grad = torch.randn(4, generator=g)
    xps[1].grad = cps[1].grad.to(XLA)
    n = torch.nn.utils.clip_grad_norm_(xps, 1.0)
    assert_same(n, torch.nn.utils.clip_grad_norm_(cps, 1.0), rtol=1e-5, atol=1e-6)
    assert_same(xps[1].grad, cps[1].grad, rtol=1e-5, atol=1e-6)
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_


def test_clip_grad_norm_inf():
    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(5, 4, generator=g), torch.randn(7, generator=g)]
    cps = [p.clone().requires_grad_() for p in ps]
    xps = [p.to(XLA).requires_grad_() for p in ps]
    for c, x in zip(cps, xps):
        c.grad = torch.randn(c.shape, generator=g) * 3
        x.grad = c.grad.to(XLA)
    for norm_type in (float("inf"), 2.0):
        cn = torch.nn.utils.clip_grad_norm_(cps, 0.7, norm_type=norm_type, foreach=True)
        xn = torch.nn.utils.clip_grad_norm_(xps, 0.7, norm_type=norm_type, foreach=True)
        # One barrier for all results (reading one output of the multi-output
        # _foreach_mul node alone once let the engine donate an input buffer that the
        # node's other, still pending, outputs needed: "Array has been deleted").
        torch_xla.sync()
        assert_same(xn, cn, rtol=1e-5, atol=1e-6)
        for c, x in zip(cps, xps):
            assert_same(x.grad, c.grad, rtol=1e-5, atol=1e-6)


def _foreach_cases():
    g = torch.Generator().manual_seed(5)
    a = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    b = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    c = [torch.rand(3, 4, generator=g) + 0.5, torch.rand(5, generator=g) + 0.5]
    return a, b, c


@pytest.mark.parametrize("fn", [
    lambda a, b, c: torch._foreach_add(a, b, alpha=0.3),
    lambda a, b, c: torch._foreach_add(a, 2.5),
    lambda a, b, c: torch._foreach_add(a, [1.5, -2.0]),
    lambda a, b, c: torch._foreach_sub(a, b, alpha=2.0),
    lambda a, b, c: torch._foreach_sub(a, [0.5, 3.0]),
    lambda a, b, c: torch._foreach_mul(a, b),
    lambda a, b, c: torch._foreach_mul(a, 0.7),
    lambda a, b, c: torch._foreach_mul(a, [0.5, 3.0]),
    lambda a, b, c: torch._foreach_div(a, c),
    lambda a, b, c: torch._foreach_div(a, [0.5, 3.0]),
    lambda a, b, c: torch._foreach_maximum(a, b),
    lambda a, b, c: torch._foreach_minimum(a, 0.1),
    lambda a, b, c: torch._foreach_clamp_min(a, [0.0, 0.2]),
    lambda a, b, c: torch._foreach_clamp_max(a, 0.3),
    lambda a, b, c: torch._foreach_pow(c, 2.5),
    lambda a, b, c: torch._foreach_pow(c, b),
    lambda a, b, c: torch._foreach_pow(2.0, a),
    lambda a, b, c: torch._foreach_addcmul(a, b, c, value=0.5),
    lambda a, b, c: torch._foreach_addcmul(a, b, c, [0.5, -1.5]),
    lambda a, b, c: torch._foreach_addcdiv(a, b, c, value=-0.25),
    lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.5, -1.5]),
    lambda a, b, c: torch._foreach_lerp(a, b, 0.3),
    lambda a, b, c: torch._foreach_lerp(a, b, 0.8),
    lambda a, b, c: torch._foreach_lerp(a, b, c),
    lambda a, b, c: torch._foreach_lerp(a, b, [0.2, 0.9]),
    lambda a, b, c: torch._foreach_sqrt(c),
    lambda a, b, c: torch._foreach_exp(a),
    lambda a, b, c: torch._foreach_neg(a),
    lambda a, b, c: torch._foreach_abs(a),
    lambda a, b, c: torch._foreach_reciprocal(c),
    lambda a, b, c: torch._foreach_sign(a),
    lambda a, b, c: torch._foreach_norm(a),
    lambda a, b, c: torch._foreach_norm(a, 1),
    lambda a, b, c: torch._foreach_norm(a, 3),
    lambda a, b, c: torch._foreach_norm(a, float("inf")),
    lambda a, b, c: torch._foreach_max(a),
])
def test_foreach_ops(fn):
    a, b, c = _foreach_cases()
    cout = fn(a, b, c)
    met.clear_all()
    xa, xb, xc = ([t.to(XLA) for t in ts] for ts in (a, b, c))
    xout = fn(xa, xb, xc)
    torch_xla.sync()
    assert_same(xout, cout, rtol=1e-5, atol=1e-6)
    assert not _fallbacks(), _fallbacks()


def test_foreach_inplace():
    a, b, c = _foreach_cases()
    xa, xb, xc = ([t.to(XLA) for t in ts] for ts in (a, b, c))
    for ts, (p, q, r) in ((a, (a, b, c)), (xa, (xa, xb, xc))):
        torch._foreach_mul_(p, 0.9)
        torch._foreach_add_(p, q, alpha=0.1)
        torch._foreach_addcdiv_(p, q, r, [0.5, 0.25])
        torch._foreach_zero_(q)
    torch_xla.sync()
    assert_same(xa, a)
    assert_same(xb, b)


def test_scalarlist_values_do_not_recompile():
    a, b, c = _foreach_cases()
    xa = [t.to(XLA) for t in a]
    torch._foreach_mul_(xa, [0.5, 0.25])
    torch_xla.sync()
    torch._foreach_mul_(xa, [0.7, 0.75])
    torch_xla.sync()
    n = _compiles()
    torch._foreach_mul_(xa, [1.5, 2.0])
    torch_xla.sync()
    assert _compiles() == n
    expect = [a[0] * 0.5 * 0.7 * 1.5, a[1] * 0.25 * 0.75 * 2.0]
    assert_same(xa, expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_foreach_dtypes(dtype):
    a, b, c = ([t.to(dtype) for t in ts] for ts in _foreach_cases())
    fns = [
        lambda a, b, c: torch._foreach_add(a, b, alpha=0.3),
        lambda a, b, c: torch._foreach_mul(a, [0.1, 3.0]),
        lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.5, -1.5]),
        lambda a, b, c: torch._foreach_lerp(a, b, 0.3),
        lambda a, b, c: torch._foreach_sqrt(c),
    ]
    xa, xb, xc = ([t.to(XLA) for t in ts] for ts in (a, b, c))
    outs = [f(xa, xb, xc) for f in fns]
    torch_xla.sync()
    for f, xo in zip(fns, outs):
        co = f(a, b, c)
        assert [t.dtype for t in xo] == [t.dtype for t in co]
        # bf16/f16: the engine passes Scalar arguments (alpha, weight) as parameters of the
        # tensors' dtype, so 0.3 is rounded to bf16 first where the CPU uses it in f32.
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=0.01, atol=8e-3)
        assert_same(xo, co, **tol)


def test_clip_grad_norm_is_traced_by_dynamo():
    """The installed clip_grad_norm_ is PyTorch's to TorchDynamo: one graph, no break."""
    import torch._dynamo
    m = torch.nn.Linear(4, 2)
    for p in m.parameters():
        p.grad = torch.ones_like(p)

    def step(x):
        return torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) * x

    assert torch.nn.utils.clip_grad_norm_._orig is not torch.nn.utils.clip_grad_norm_
    ex = torch._dynamo.explain(step)(torch.ones(3))
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
