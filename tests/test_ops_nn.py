"""Neural-network ops (torch_xla/_engine/lowering/nn_ops.py) against eager PyTorch on the CPU."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla._engine.lowering import LOWERINGS

from helpers import XLA, assert_same, check_flat

torch.manual_seed(0)


def _base(name):
    return "aten::" + name.split(".")[0]


_NN = {_base(n) for n, low in LOWERINGS.items() if low.fn.__module__.endswith("nn_ops")}
_LOWERED = {_base(n) for n in LOWERINGS if "::" not in n}


def fallbacks():
    return {c for c in met.counter_names() if c.startswith("aten::") and c != "aten::_local_scalar_dense"}


def assert_no_fallback(extra=()):
    """No op of this family (or any op that has a lowering) ran on the CPU fallback.

    Ops without any lowering yet (other families' work in progress) are tolerated; the
    `extra` names must not fall back either."""
    fb = fallbacks()
    bad = {c for c in fb if c in _NN or c in _LOWERED or c in set(extra)}
    assert not bad, f"CPU fallback for {sorted(bad)} (all fallbacks: {sorted(fb)})"


_PENDING = []


@pytest.fixture(autouse=True)
def _deferred(monkeypatch):
    """Checks of a test are compared after its end, all from one device program (one
    compile per test keeps the file fast)."""
    met.clear_all()
    _PENDING.clear()
    yield
    flush()


def flush():
    torch_xla.sync()
    checks = list(_PENDING)
    _PENDING.clear()
    for c in checks:
        c()
    assert_no_fallback(getattr(flush, "extra", ()))


def _grad_outputs(outs):
    return [torch.ones_like(o) * 0.5 + torch.arange(o.numel()).reshape(o.shape).to(o.dtype) / max(o.numel(), 1)
            for o in outs]


def check(fn, *args, rtol=1e-5, atol=1e-5, grad=True):
    """check_op (helpers.py), deferred: fn and its gradients run on CPU tensors and on
    their xla copies now; the comparison happens at the end of the test (after one sync)."""
    cargs = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    xargs = [a.detach().to(XLA).requires_grad_(grad and a.is_floating_point()) for a in args]
    cout = fn(*cargs)
    xout = fn(*xargs)
    cg = xg = ()
    if grad:
        couts = [o for o in (cout if isinstance(cout, (list, tuple)) else [cout]) if o.requires_grad]
        xouts = [o for o in (xout if isinstance(xout, (list, tuple)) else [xout]) if o.requires_grad]
        cin = [a for a in cargs if a.requires_grad]
        xin = [a for a in xargs if a.requires_grad]
        gs = _grad_outputs(couts)
        cg = torch.autograd.grad(couts, cin, gs, allow_unused=True)
        xg = torch.autograd.grad(xouts, xin, [g.to(XLA) for g in gs], allow_unused=True)

    def compare():
        assert_same(xout, cout, rtol=rtol, atol=atol)
        for a, b in zip(xg, cg):
            if b is None:
                assert a is None
            else:
                assert_same(a, b, rtol=rtol * 10, atol=atol * 10)
    _PENDING.append(compare)


def check_module(mod, *inputs, rtol=1e-5, atol=1e-5, train=True):
    """Same module (deep copy) on both devices: outputs, input grads, parameter grads and
    buffers (batch-norm running statistics) are compared (deferred, as in check)."""
    cmod = mod
    cmod.zero_grad(set_to_none=True)
    xmod = copy.deepcopy(mod).to(XLA)
    cmod.train(train)
    xmod.train(train)
    cin = [i.detach().clone().requires_grad_(i.is_floating_point()) for i in inputs]
    xin = [i.detach().to(XLA).requires_grad_(i.is_floating_point()) for i in inputs]
    cout = cmod(*cin)
    xout = xmod(*xin)
    g = torch.randn(cout.shape)
    cout.backward(g)
    xout.backward(g.to(XLA))
    # snapshot now: the module may run again later in the test
    pairs = [(xout, cout, rtol, atol, "output")]
    pairs += [(a.grad, b.grad, rtol * 10, atol * 10, "input grad") for a, b in zip(xin, cin) if b.grad is not None]
    pairs += [(px.grad, pc.grad, rtol * 10, atol * 10, n + ".grad")
              for (n, pc), (_, px) in zip(cmod.named_parameters(), xmod.named_parameters())]
    pairs += [(bx.clone(), bc.clone(), rtol, atol, n)
              for (n, bc), (_, bx) in zip(cmod.named_buffers(), xmod.named_buffers())]

    def compare():
        for a, b, rt, at, msg in pairs:
            assert_same(a, b, rtol=rt, atol=at, msg=msg)
    _PENDING.append(compare)
    return xmod, cmod


# ---- convolution -----------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),
    dict(stride=2, padding=1),
    dict(padding=2, dilation=2),
    dict(groups=2, padding=1),
    dict(stride=(2, 1), padding=(0, 1), bias=False),
])
def test_conv2d(kw):
    kw = dict(kw)
    bias = kw.pop("bias", True)
    g = kw.get("groups", 1)
    x = torch.randn(2, 4, 7, 6)
    w = torch.randn(6, 4 // g, 3, 3)
    b = torch.randn(6) if bias else None
    if b is None:
        check(lambda x, w: F.conv2d(x, w, **kw), x, w)
    else:
        check(lambda x, w, b: F.conv2d(x, w, b, **kw), x, w, b)


def test_conv_padding_same():
    check(lambda x, w: F.conv2d(x, w, padding="same", dilation=2), torch.randn(1, 2, 6, 7), torch.randn(3, 2, 4, 3))
    check(lambda x, w: F.conv1d(x, w, padding="valid"), torch.randn(1, 2, 6), torch.randn(3, 2, 4))


def test_conv1d_conv3d():
    check(lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1), torch.randn(2, 3, 9), torch.randn(4, 3, 3),
          torch.randn(4))
    check(lambda x, w: F.conv3d(x, w, padding=1, groups=2), torch.randn(1, 4, 4, 5, 4), torch.randn(2, 2, 3, 3, 3))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(stride=2, output_padding=1),
    dict(stride=2, padding=1, dilation=2, groups=2),
])
def test_conv_transpose2d(kw):
    g = kw.get("groups", 1)
    x = torch.randn(2, 4, 5, 4)
    w = torch.randn(4, 6 // g, 3, 3)
    check(lambda x, w, b: F.conv_transpose2d(x, w, b, **kw), x, w, torch.randn(6))


def test_conv_transpose1d_3d():
    check(lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=1, output_padding=2), torch.randn(2, 3, 5),
          torch.randn(3, 2, 4))
    check(lambda x, w: F.conv_transpose3d(x, w, stride=2), torch.randn(1, 2, 3, 2, 3), torch.randn(2, 3, 2, 2, 2))


# The CPU formulations of convolution (lowering/conv_cpu.py), forward and both gradients:
# patches (im2col) and, for large patch matrices, XLA's own convolution.
_CPU_CONV_CASES = [
    (True, (4, 1, 28, 28), (10, 1, 5, 5), 1, 0, 1),
    (True, (2, 1, 10, 10), (3, 1, 3, 3), 2, 1, 2),
    (True, (2, 3, 32, 32), (8, 3, 7, 7), 2, 3, 1),
    (True, (2, 16, 2, 2), (16, 16, 3, 3), 1, 1, 1),      # input smaller than the kernel
    (True, (2, 8, 9, 9), (16, 8, 3, 3), 2, 1, 1),
    (True, (2, 4, 11, 11), (6, 4, 3, 3), 1, 2, 2),
    (True, (2, 3, 17), (5, 3, 4), 3, 1, 1),
    (True, (1, 2, 5, 6, 7), (3, 2, 2, 3, 2), (1, 2, 1), 1, 1),
    (False, (2, 4, 11, 12), (6, 4, 3, 3), 1, 2, 2),     # (a shape no other case compiles)
]


@pytest.mark.parametrize("im2col,xs,ws,stride,padding,dilation", _CPU_CONV_CASES)
def test_conv_cpu_formulations(monkeypatch, im2col, xs, ws, stride, padding, dilation):
    from torch_xla._engine.lowering import conv_cpu
    if not im2col:
        monkeypatch.setattr(conv_cpu, "PATCH_BYTES_MAX", 0)   # XLA's convolution
    nsp = len(xs) - 2
    tup = lambda v: (v,) * nsp if isinstance(v, int) else tuple(v)
    assert conv_cpu.use_im2col(xs, ws, tup(stride), tup(padding), tup(dilation)) == im2col
    conv = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
    check(lambda x, w, b: conv(x, w, b, stride=stride, padding=padding, dilation=dilation),
          torch.randn(xs), torch.randn(ws), torch.randn(ws[0]), rtol=1e-4, atol=1e-4)
    torch_xla.sync()   # lower while the patched limit is in force


def test_conv_module_no_input_grad():
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1, bias=False))
    check_module(m, torch.randn(2, 3, 6, 6))


# ---- pooling ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(kernel_size=2),
    dict(kernel_size=(3, 2)),     # tiling windows of unequal sides: the index by arithmetic
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=1, dilation=2),
])
def test_max_pool2d(kw):
    x = torch.randn(2, 3, 7, 8)
    check(lambda x: F.max_pool2d(x, **kw), x)
    check(lambda x: F.max_pool2d(x, return_indices=True, **kw)[1], x, grad=False)


def test_max_pool_indices_ties_and_unbatched():
    x = torch.tensor([[[1., 1., 0., 2.], [3., 3., 2., 2.], [0., 0., 0., 0.], [5., 4., 5., 4.]]])
    check(lambda x: F.max_pool2d(x, 2, return_indices=True), x, grad=False)
    check(lambda x: F.max_pool2d(x, 2), x)


@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(3, 2), stride=(2, 1),
                                                                             padding=(1, 0), ceil_mode=True)])
def test_max_pool_overlapping_windows_ties_and_infinities(kw):
    # Overlapping windows are taken one kernel offset at a time: the first maximum of a
    # window of ties, the first valid element of a window of -inf, gradients summed where
    # windows share their argmax.
    torch.manual_seed(0)
    ties = torch.randint(0, 3, (2, 3, 9, 7)).float()
    infs = torch.full((1, 2, 7, 7), float("-inf"))
    infs[..., 3, 3] = 1.0
    for x in (ties, infs):
        check(lambda x: F.max_pool2d(x, return_indices=True, **kw)[1], x, grad=False)
        check(lambda x: F.max_pool2d(x, **kw), x, grad=x is ties)
    check(lambda x: F.max_pool3d(x, 3, 2, 1), torch.randn(1, 2, 5, 6, 7))


@pytest.mark.parametrize("args", [(1, 2), (1, 2, 0, 2), (7, 1, 3)])
def test_max_pool_one_offset_and_large_kernels(args):
    # A one-element kernel (Detectron2's LastLevelMaxPool: kernel 1, stride 2), and a
    # kernel of more offsets than are unrolled (its windows are gathered).
    x = torch.randn(2, 3, 9, 8)
    check(lambda x: F.max_pool2d(x, *args), x)
    check(lambda x: F.max_pool2d(x, *args, return_indices=True)[1], x, grad=False)
    check(lambda x: F.max_pool1d(x, *args), x[0])


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1)])
def test_max_pool_nan_windows(kw):
    # The CPU kernel takes an element if it is greater than the maximum so far or NaN:
    # a window's last NaN is its argmax, and its gradient goes there.
    nan = float("nan")
    x = torch.tensor([[[nan, 1., nan, 0., 2., nan], [nan, 2., 3., nan, 1., 1.], [0., 1., 2., 3., 4., 5.],
                       [nan, nan, nan, nan, 7., 7.], [1., 2., 3., 4., 5., 6.], [6., 5., nan, 3., 2., 1.]]])
    check_flat(lambda x: F.max_pool2d(x, return_indices=True, **kw), x, grad=True)


def test_max_pool1d_3d():
    check(lambda x: F.max_pool1d(x, 3, stride=2, padding=1), torch.randn(2, 3, 9))
    check(lambda x: F.max_pool1d(x, 2, return_indices=True), torch.randn(2, 3, 8), grad=False)
    check(lambda x: F.max_pool3d(x, 2, stride=1), torch.randn(1, 2, 3, 4, 4))
    check(lambda x: F.max_pool3d(x, (1, 3, 2), return_indices=True)[1], torch.randn(1, 2, 3, 7, 5), grad=False)
    check(lambda x: F.max_pool3d(x, (1, 3, 2)), torch.randn(1, 2, 3, 7, 5))
    check(lambda x: F.max_pool3d(x, 2, return_indices=True, ceil_mode=True), torch.randn(1, 2, 3, 5, 4),
          grad=False)


@pytest.mark.parametrize("kw", [
    dict(kernel_size=2),
    dict(kernel_size=(3, 2)),     # tiling windows of unequal sides: the index by arithmetic
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=(2, 3), padding=1, divisor_override=5),
])
def test_avg_pool2d(kw):
    check(lambda x: F.avg_pool2d(x, **kw), torch.randn(2, 3, 7, 8))


def test_avg_pool1d_3d():
    check(lambda x: F.avg_pool1d(x, 3, stride=2, padding=1, ceil_mode=True), torch.randn(2, 3, 8))
    check(lambda x: F.avg_pool3d(x, 2, stride=1, padding=1, count_include_pad=False), torch.randn(1, 2, 3, 4, 4))


@pytest.mark.parametrize("out", [1, 3, (2, 5), (7, 4)])
def test_adaptive_avg_pool2d(out):
    check(lambda x: F.adaptive_avg_pool2d(x, out), torch.randn(2, 3, 7, 8))


def test_adaptive_avg_pool1d_3d():
    check(lambda x: F.adaptive_avg_pool1d(x, 3), torch.randn(2, 3, 8))
    check(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), torch.randn(1, 2, 3, 5, 4))


@pytest.mark.parametrize("out", [1, 3, (2, 5)])
def test_adaptive_max_pool2d(out):
    x = torch.randn(2, 3, 7, 8)
    check(lambda x: F.adaptive_max_pool2d(x, out), x)
    check(lambda x: F.adaptive_max_pool2d(x, out, return_indices=True), x, grad=False)


def test_adaptive_max_pool1d_3d():
    check(lambda x: F.adaptive_max_pool1d(x, 3), torch.randn(2, 3, 8))
    check(lambda x: F.adaptive_max_pool3d(x, 2), torch.randn(1, 2, 3, 5, 4))


# ---- normalization ---------------------------------------------------------------------

@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_module(affine):
    m = nn.BatchNorm2d(3, momentum=0.3, affine=affine)
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    xmod, cmod = check_module(m, x)
    # a second step, then eval mode with the updated running stats
    check_module(cmod, x * 0.5)
    check_module(m, x, train=False)


def test_batch_norm_1d_3d_and_no_stats():
    check_module(nn.BatchNorm1d(4), torch.randn(5, 4))
    check_module(nn.BatchNorm1d(4), torch.randn(5, 4, 3))
    check_module(nn.BatchNorm3d(2), torch.randn(2, 2, 3, 2, 3))
    check_module(nn.BatchNorm2d(3, track_running_stats=False), torch.randn(4, 3, 2, 2))
    check_module(nn.BatchNorm2d(3, momentum=None), torch.randn(4, 3, 2, 2))


def test_batch_norm_functional():
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    x, w, b = torch.randn(4, 3, 2, 2), torch.randn(3), torch.randn(3)
    xrm, xrv = rm.to(XLA), rv.to(XLA)
    check(lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=False, eps=1e-3),
          x, w, b)
    crm, crv = rm.clone(), rv.clone()
    check(lambda x, w, b: F.batch_norm(x, crm if x.device.type == "cpu" else xrm,
                                       crv if x.device.type == "cpu" else xrv, w, b, training=True,
                                       momentum=0.2), x, w, b)
    flush()
    assert_same(xrm, crm)
    assert_same(xrv, crv)


def test_native_batch_norm_saved_stats():
    x, w, b = torch.randn(4, 3, 5), torch.randn(3), torch.randn(3)
    rm, rv = torch.zeros(3), torch.ones(3)
    check(lambda x, w, b, rm, rv: torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5),
          x, w, b, rm, rv, grad=False)
    check(lambda x, w, b: torch.ops.aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
          x, w, b, grad=False)
    # (the CPU kernel returns empty saved statistics here, the meta kernel 3-element ones)
    check(lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1,
                                                                                       1e-5)[0],
          x, w, b, rm, rv, grad=False)
    check(lambda x, w, b, rm, rv: torch.ops.aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1,
                                                                                      1e-5),
          x, w, b, rm, rv, grad=False)
    # the backward op of _batch_norm_with_update (save_var holds the inverse std)
    g = torch.randn(4, 3, 5)
    _, sm, si = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    for train in (True, False):
        check(lambda g, x, w, rm, rv, sm, si: torch.ops.aten.batch_norm_backward(
            g, x, w, rm, rv, sm, si, train, 1e-5, [True, True, True], torch.empty(0, device=x.device)),
            g, x, w, rm, rv, sm, si, grad=False)


@pytest.mark.parametrize("shape,affine", [((4,), True), ((3, 4), True), ((4,), False)])
def test_layer_norm(shape, affine):
    check_module(nn.LayerNorm(shape, elementwise_affine=affine, eps=1e-3), torch.randn(2, 3, 3, 4))
    if affine:
        check(lambda x, w, b: F.layer_norm(x, shape, w, b), torch.randn(2, 3, 3, 4), torch.randn(shape),
              torch.randn(shape))


@pytest.mark.parametrize("groups,affine", [(1, True), (2, True), (4, False)])
def test_group_norm(groups, affine):
    check_module(nn.GroupNorm(groups, 4, affine=affine), torch.randn(2, 4, 3, 3))
    check_module(nn.GroupNorm(groups, 4, affine=affine), torch.randn(2, 4))


def test_rms_norm():
    check_module(nn.RMSNorm(4), torch.randn(2, 3, 4))
    check_module(nn.RMSNorm((3, 4), eps=1e-3, elementwise_affine=False), torch.randn(2, 3, 4))
    check(lambda x, w: F.rms_norm(x, (4,), w), torch.randn(3, 4), torch.randn(4))


# ---- embedding -------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(padding_idx=1), dict(scale_grad_by_freq=True, padding_idx=0)])
def test_embedding(kw):
    idx = torch.tensor([[1, 2, 4, 1], [0, 4, 4, 9]])
    check_module(nn.Embedding(10, 3, **kw), idx)
    check(lambda w: F.embedding(idx if w.device.type == "cpu" else idx.to(XLA), w, **kw), torch.randn(10, 3))


def test_embedding_max_norm_renormalises_weight():
    w = torch.randn(6, 3) * 2
    idx = torch.tensor([1, 3, 3, 5])
    cm = nn.Embedding(6, 3, max_norm=1.5, _weight=w.clone())
    xm = nn.Embedding(6, 3, max_norm=1.5, _weight=w.clone()).to(XLA)
    cout, xout = cm(idx), xm(idx.to(XLA))
    flush()
    assert_same(xout, cout)
    assert_same(xm.weight, cm.weight)


# ---- losses ----------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss(reduction, weighted):
    x = torch.randn(5, 4).log_softmax(1)
    t = torch.tensor([0, 3, 1, 3, 2])
    w = torch.rand(4) + 0.1 if weighted else None

    def f(x, t):
        return F.nll_loss(x, t, weight=None if w is None else w.to(x.device), reduction=reduction, ignore_index=1)
    check(f, x, t)
    check(lambda x, t: F.nll_loss(x, t, reduction=reduction), torch.randn(4), torch.tensor(2))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss2d(reduction):
    x = torch.randn(2, 3, 4, 5)
    t = torch.randint(0, 3, (2, 4, 5))
    t[0, 0, 0] = -100
    w = torch.rand(3)
    check(lambda x, t: F.nll_loss(x, t, w.to(x.device), reduction=reduction), x, t)


def test_nll_loss_all_ignored_is_nan():
    x = torch.randn(3, 4)
    t = torch.tensor([-100, -100, -100])
    out = F.nll_loss(x.to(XLA), t.to(XLA))
    assert torch.isnan(out.cpu()) and torch.isnan(F.nll_loss(x, t))


def test_floating_class_targets_as_pytorch_xla_takes_them():
    # PyTorch/XLA's losses take class indices held in a floating tensor (`zeros(n)`); the
    # CPU wants Long: compare against the same indices as int64. A value that is no whole
    # number (2.5) is refused by a device-side check, an out-of-range one raises the CPU's
    # IndexError (with the checks off, such a value selects no class).
    x = torch.randn(6, 3, requires_grad=True)
    t = torch.tensor([0, 2, 1, 1, 0, 2])
    ref = F.cross_entropy(x, t)
    ref.backward()
    xx = x.detach().to(XLA).requires_grad_()
    out = F.cross_entropy(xx, t.float().to(XLA))
    out.backward()
    assert_same(out, ref)
    assert_same(xx.grad, x.grad)
    x4, t4 = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))
    assert_same(F.cross_entropy(x4.to(XLA), t4.double().to(XLA), reduction="sum"),
                F.cross_entropy(x4, t4, reduction="sum"))
    with pytest.raises(ValueError, match="flat position 1 is not a whole number"):
        F.nll_loss(x.detach().to(XLA), torch.tensor([0, 2.5, 1, 1, 0, 2]).to(XLA), reduction="none").cpu()
    with pytest.raises(IndexError, match="Target 5 is out of bounds"):
        F.nll_loss(x.detach().to(XLA), torch.tensor([0., 5, 1, 1, 0, 2]).to(XLA)).cpu()
    with pytest.raises(RuntimeError, match="expected target dtype to be Long or Byte, but got Bool"):
        F.nll_loss(x.detach().to(XLA), torch.ones(6, dtype=torch.bool).to(XLA))


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_cross_entropy(ls):
    x = torch.randn(6, 5)
    t = torch.tensor([0, 4, 1, 2, -100, 3])
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=ls), x, t)
    w = torch.rand(5) + 0.2
    check(lambda x, t: F.cross_entropy(x, t, weight=w.to(x.device), label_smoothing=ls, reduction="sum"), x, t)
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=ls), torch.randn(2, 3, 4), torch.randint(0, 3, (2, 4)))
    check(lambda x, p: F.cross_entropy(x, p, label_smoothing=ls), x, torch.rand(6, 5).softmax(1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses(reduction):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), x, y)
    check(lambda x, y: F.l1_loss(x, y, reduction=reduction), x, y)
    check(lambda x, y: F.smooth_l1_loss(x, y, reduction=reduction, beta=0.5), x, y)
    check(lambda x, y: F.smooth_l1_loss(x, y, reduction=reduction, beta=0.0), x, y)
    check(lambda x, y: F.huber_loss(x, y, reduction=reduction, delta=0.7), x, y)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_classification_losses(reduction):
    x, t = torch.rand(3, 4) * 0.98 + 0.01, torch.rand(3, 4)
    w = torch.rand(3, 4)
    check(lambda x: F.binary_cross_entropy(x, t.to(x.device), reduction=reduction), x)
    check(lambda x: F.binary_cross_entropy(x, t.to(x.device), w.to(x.device), reduction=reduction), x)
    lg = torch.randn(3, 4) * 3
    check(lambda x: F.binary_cross_entropy_with_logits(x, t.to(x.device), reduction=reduction), lg)
    pw = torch.rand(4) + 0.5
    check(lambda x: F.binary_cross_entropy_with_logits(x, t.to(x.device), w.to(x.device),
                                                       pos_weight=pw.to(x.device), reduction=reduction), lg)
    y = torch.randint(0, 2, (3, 4)).float() * 2 - 1
    check(lambda x: F.soft_margin_loss(x, y.to(x.device), reduction=reduction), lg)
    check(lambda x: F.kl_div(x, t.to(x.device), reduction="batchmean" if reduction == "mean" else reduction),
          torch.randn(3, 4).log_softmax(1))


# ---- dropout ---------------------------------------------------------------------------

def test_dropout_statistics():
    x = torch.ones(100, 100, device=XLA, requires_grad=True)
    y = F.dropout(x, 0.3, training=True)
    y2 = F.dropout(x, 0.3, training=True)
    y.backward(torch.full_like(y, 2.0))
    torch_xla.sync()
    yc, y2c, gc = y.cpu(), y2.cpu(), x.grad.cpu()
    kept = yc != 0
    frac = kept.float().mean().item()
    assert abs(frac - 0.7) < 0.03, frac
    assert torch.allclose(yc[kept], torch.full_like(yc[kept], 1 / 0.7))
    assert torch.equal(gc != 0, kept)
    assert torch.allclose(gc[kept], torch.full_like(gc[kept], 2 / 0.7))
    assert not torch.equal(y2c != 0, kept)  # a new mask on each call


def test_dropout_eval_and_edge_cases():
    x = torch.randn(4, 5)
    check(lambda x: F.dropout(x, 0.5, training=False), x)
    check_module(nn.Dropout(0.4), x, train=False)
    check(lambda x: F.dropout(x, 1.0, training=True), x)
    check(lambda x: F.dropout(x, 0.0, training=True), x)


# ---- upsampling ------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(scale_factor=2, mode="nearest"),
    dict(size=(5, 7), mode="nearest"),
    dict(scale_factor=1.7, mode="nearest"),
    dict(size=(5, 3), mode="nearest-exact"),
    dict(scale_factor=2, mode="bilinear"),
    dict(size=(5, 7), mode="bilinear", align_corners=True),
    dict(size=(3, 9), mode="bilinear", align_corners=False),
    dict(scale_factor=0.6, mode="bilinear"),
    dict(size=(6, 9), mode="bicubic"),
    dict(scale_factor=1.5, mode="bicubic", align_corners=True),
])
def test_interpolate_2d(kw):
    check(lambda x: F.interpolate(x, **kw), torch.randn(2, 3, 4, 5))


def test_interpolate_1d_3d():
    check(lambda x: F.interpolate(x, scale_factor=2.5, mode="linear"), torch.randn(2, 3, 4))
    check(lambda x: F.interpolate(x, size=7, mode="nearest"), torch.randn(2, 3, 4))
    check(lambda x: F.interpolate(x, size=(3, 4, 5), mode="trilinear", align_corners=True),
          torch.randn(1, 2, 2, 3, 4))
    check(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), torch.randn(1, 2, 2, 3, 2))


# ---- attention -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa", "scale"])
def test_sdpa(case):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    kw = {}
    if case == "causal":
        k, v = k[:, :, :5], v[:, :, :5]
        kw = dict(is_causal=True)
    elif case == "bool_mask":
        m = torch.rand(5, 6) > 0.3
        m[:, 0] = True
        m[2] = False  # a fully masked row
        kw = dict(attn_mask=m)
    elif case == "float_mask":
        kw = dict(attn_mask=torch.randn(2, 1, 5, 6))
    elif case == "gqa":
        k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        kw = dict(enable_gqa=True)
    elif case == "scale":
        kw = dict(scale=0.3)

    def f(q, k, v):
        kk = {a: (b.to(q.device) if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
        return F.scaled_dot_product_attention(q, k, v, **kk)
    check(f, q, k, v, rtol=1e-4, atol=1e-5)


def test_multihead_attention_module():
    m = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x, x, x, need_weights=False, is_causal=False)[0]
    check_module(Wrap(), x, rtol=1e-4)
    flush()


# ---- padding, glu, pixel shuffle, fold/unfold -------------------------------------------

@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_pad_modes(mode):
    check(lambda x: F.pad(x, (2, 1), mode=mode), torch.randn(2, 3, 5))
    check(lambda x: F.pad(x, (2, 1, 1, 2), mode=mode), torch.randn(2, 3, 4, 5))
    check(lambda x: F.pad(x, (1, 0, 2, 1), mode=mode), torch.randn(3, 4, 5))
    check(lambda x: F.pad(x, (1, 2, 0, 1, 1, 1), mode=mode), torch.randn(1, 2, 3, 3, 4))
    flush()


def test_pad_negative_and_errors():
    check(lambda x: F.pad(x, (-1, 2, 1, -2), mode="replicate"), torch.randn(2, 3, 4, 5))
    check(lambda x: F.pad(x, (2, -1), mode="reflect"), torch.randn(2, 3, 5))
    with pytest.raises(RuntimeError):
        F.conv2d(torch.randn(1, 2, 4, 4, device=XLA), torch.randn(3, 2, 3, 3, device=XLA), padding=-1)
    with pytest.raises(RuntimeError):
        F.embedding(torch.tensor([1], device=XLA), torch.randn(4, 3, 2, device=XLA))


def test_glu_pixel_shuffle():
    check(lambda x: F.glu(x, 1), torch.randn(2, 6, 3))
    check(lambda x: F.glu(x), torch.randn(2, 3, 4))
    check(lambda x: F.pixel_shuffle(x, 2), torch.randn(2, 8, 3, 3))
    check(lambda x: F.pixel_unshuffle(x, 2), torch.randn(2, 2, 4, 6))


def test_unfold_fold():
    check(lambda x: F.unfold(x, 3), torch.randn(2, 3, 5, 6))
    check(lambda x: F.unfold(x, 2), torch.randn(0, 3, 4, 4))
    check(lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=2), torch.randn(2, 3, 5, 6))
    check(lambda x: F.fold(x, (4, 5), 2), torch.randn(2, 12, 12))
    check(lambda x: F.fold(x, (5, 6), (2, 3), dilation=(1, 2), padding=1, stride=2), torch.randn(2, 18, 6))


def test_forward_only_paths():
    """Without autograd some functionals take other routes (max_pool1d has a CPU-only one)."""
    x1, x2 = torch.randn(2, 3, 9), torch.randn(2, 3, 6, 6)
    check(lambda x: F.max_pool1d(x, 3, 2), x1, grad=False)
    check(lambda x: F.max_pool2d(x, 3, 2, padding=1), x2, grad=False)
    check(lambda x: F.avg_pool1d(x, 3, 2), x1, grad=False)
    check(lambda x: F.adaptive_max_pool1d(x, 4), x1, grad=False)
    check(lambda x: F.interpolate(x, scale_factor=2), (x2 * 5).to(torch.uint8), grad=False)
    check(lambda x: F.batch_norm(x, None, None, training=True), x2, grad=False)


def test_low_precision_and_double():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    check(lambda x, w: F.conv2d(x, w, padding=1), x.double(), w.double())
    check(lambda x, w: F.conv2d(x, w, padding=1), x.bfloat16(), w.bfloat16(), rtol=2e-2, atol=2e-2, grad=False)
    for f in (lambda x: F.layer_norm(x, (6,)), lambda x: F.group_norm(x, 3),
              lambda x: F.batch_norm(x, None, None, training=True),
              lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), lambda x: F.avg_pool2d(x, 2)):
        check(f, x.bfloat16(), rtol=2e-2, atol=2e-2, grad=False)


# ---- a small CNN end to end ------------------------------------------------------------

def test_small_cnn_training_step():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8), nn.GELU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.0), nn.Linear(8, 5))
    x = torch.randn(4, 3, 8, 8)
    t = torch.tensor([0, 3, 4, 1])

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return F.cross_entropy(self.net(x), t.to(x.device), label_smoothing=0.1)
    check_module(WithLoss(), x, rtol=1e-4, atol=1e-5)


def test_donation_with_shared_pending_graph(monkeypatch):
    """Reading the updated running mean, then the output (which shares the graph)."""
    monkeypatch.delenv("XLA_NO_DONATION", raising=False)
    m = nn.BatchNorm2d(3).to(XLA)
    x = torch.randn(2, 3, 4, 4)
    cm = nn.BatchNorm2d(3)
    cy = cm(x)
    y = m(x.to(XLA))
    rm = m.running_mean.cpu()
    yc = y.cpu()
    assert_same(yc, cy)
    assert_same(rm, cm.running_mean)


def test_max_pool_tiling_windows_values_indices_grads():
    """Windows that tile the input (stride == kernel) take a reshape/elementwise path:
    values, indices (first max on ties, NaN wins) and gradients as on the CPU."""
    from helpers import check_flat
    import torch.nn.functional as F
    torch.manual_seed(0)
    x2 = torch.randn(2, 3, 9, 8)
    x2[0, 0, 0, 0] = float("nan")
    x2[1, 1, :2, :2] = 1.5  # a tie inside one window
    check_flat(lambda a: F.max_pool2d(a, 2, return_indices=True), x2, grad=True)
    check_flat(lambda a: F.max_pool2d(a, (3, 2), return_indices=True), x2, grad=True)
    check_flat(lambda a: F.max_pool1d(a, 3, return_indices=True), torch.randn(2, 4, 10), grad=True)
    check_flat(lambda a: F.max_pool3d(a, 2, return_indices=True), torch.randn(1, 2, 4, 5, 6), grad=True)
    check_flat(lambda a: F.max_pool2d(a, 2, ceil_mode=True, return_indices=True), x2, grad=True)


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
@pytest.mark.parametrize("bias", [pytest.param(True, marks=pytest.mark.slow), False])   # ~8 s each
def test_recurrent_modules_run_their_fused_cells_on_the_device(cls, bias):
    """PyTorch's GRU / LSTM call the fused cells on the xla device (the CPU has no kernel
    for them); bidirectional takes PyTorch's own GRU code, not the program-loop one."""
    torch.manual_seed(0)
    m = getattr(torch.nn, cls)(6, 5, num_layers=1, bias=bias, batch_first=True, bidirectional=True)
    x = torch.randn(3, 3, 6, requires_grad=True)
    o, h = m(x)
    h = h[1] if cls == "LSTM" else h      # the LSTM's cell state: its own gradient path
    (o.sum() + (h * h).sum()).backward()
    ref = [o, h, x.grad] + [p.grad for p in m.parameters()]
    met.clear_all()
    mx = m.to("xla")
    mx.zero_grad()
    xx = x.detach().to("xla").requires_grad_()
    o2, h2 = mx(xx)
    h2 = h2[1] if cls == "LSTM" else h2
    (o2.sum() + (h2 * h2).sum()).backward()
    got = [o2, h2, xx.grad] + [p.grad for p in mx.parameters()]
    for a, b in zip(ref, got):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)
    assert [c for c in met.counter_names() if c.startswith("aten::")] == []


def test_lstm_cell_with_an_unused_cell_state():
    torch.manual_seed(0)
    m = torch.nn.LSTMCell(4, 3)
    x = torch.randn(2, 4)
    m(x)[0].sum().backward()
    ref = [p.grad.clone() for p in m.parameters()]
    mx = m.to("xla")
    mx.zero_grad()
    mx(x.to("xla"))[0].sum().backward()
    for a, p in zip(ref, mx.parameters()):
        torch.testing.assert_close(p.grad.cpu(), a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2,), (5, 2), (4, 3, 2), (2, 2, 3, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_patched_linear_matches_cpu_linear(shape, bias):
    """XLAPatchedLinear (SPMD / FSDP's linear): forward and gradients as the CPU's
    nn.Linear at every input rank, computed as one dot per product with no reshape."""
    import copy
    import torch.nn as nn
    from torch_xla.distributed.spmd import xla_sharding as xs
    torch.manual_seed(0)
    ref = nn.Linear(2, 4, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    m = xs.apply_xla_patch_to_nn_linear(copy.deepcopy(ref).to("xla"))
    xx = x.detach().to("xla").requires_grad_()
    out = m(xx)
    if len(shape) > 1 and not bias:   # (the bias add broadcasts through a reshape)
        assert "reshape" not in torch_xla._XLAC._get_xla_tensors_hlo([out])
    out_ref = ref(x)
    (out * out).sum().backward()
    (out_ref * out_ref).sum().backward()
    torch.testing.assert_close(out.cpu(), out_ref.detach())
    torch.testing.assert_close(xx.grad.cpu(), x.grad)
    torch.testing.assert_close(m.weight.grad.cpu(), ref.weight.grad)
    if bias:
        torch.testing.assert_close(m.bias.grad.cpu(), ref.bias.grad)


def test_patched_linear_under_autocast_computes_in_bf16():
    import copy
    import torch.nn as nn
    from torch_xla.distributed.spmd import xla_sharding as xs
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    x = torch.randn(3, 5, 8)
    m = xs.apply_xla_patch_to_nn_linear(copy.deepcopy(ref).to("xla"))
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = m(x.to("xla"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = ref(x)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), out_ref.detach().float(), rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([m.weight.grad])
    assert "bf16" in [ln for ln in hlo.splitlines() if " dot(" in ln][0]
