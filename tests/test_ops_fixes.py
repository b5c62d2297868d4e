"""Ops whose lowerings or decompositions were added or corrected: each compared with eager
PyTorch on the CPU (values, gradients, dtypes), and checked to run without a CPU fallback."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.debug.metrics as met

DEV = torch.device("xla", 0)
# CPU fallbacks that are part of an op's design (a host read of a data-dependent size).
_ALLOWED = {"aten::_local_scalar_dense", "aten::nonzero"}


def _dev(t):
    return t.detach().to(DEV).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def _fallbacks():
    return {n for n in met.counter_names() if n.startswith("aten::")} - _ALLOWED


def _close(x, c, **tol):
    if isinstance(c, (tuple, list)):
        assert len(x) == len(c)
        for a, b in zip(x, c):
            _close(a, b, **tol)
        return
    assert x.dtype == c.dtype, (x.dtype, c.dtype)
    assert x.shape == c.shape, (x.shape, c.shape)
    torch.testing.assert_close(x.detach().cpu(), c.detach(), equal_nan=True, **tol)


def _check(fn, *args, grad=False, native=True, **tol):
    """fn on the CPU and on the device: equal results (and gradients of the floating
    inputs that require grad, for a fixed cotangent), no CPU fallback."""
    cargs = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    xargs = [_dev(a) for a in args]
    c = fn(*cargs)
    met.clear_all()
    x = fn(*xargs)
    torch_xla.sync()
    _close(x, c, **tol)
    if native:
        assert not _fallbacks(), _fallbacks()
    if grad:
        cin = [a for a in cargs if isinstance(a, torch.Tensor) and a.requires_grad]
        xin = [a for a in xargs if isinstance(a, torch.Tensor) and a.requires_grad]
        cot = torch.randn(c.shape, generator=torch.Generator().manual_seed(0), dtype=c.dtype)
        cg = torch.autograd.grad(c, cin, cot)
        met.clear_all()
        xg = torch.autograd.grad(x, xin, cot.to(DEV))
        torch_xla.sync()
        _close(xg, cg, rtol=1e-4, atol=1e-4)
        if native:
            assert not _fallbacks(), _fallbacks()


def _rand(*shape, dtype=torch.float32, grad=False, seed=0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


# ---- elementwise -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logsigmoid_forward_buffer_and_grad(dtype):
    x = _rand(4, 5, dtype=dtype, grad=dtype == torch.float32)
    _check(F.logsigmoid, x, grad=x.requires_grad)
    _check(lambda t: torch.ops.aten.log_sigmoid_forward(t), x.detach())


def test_multilabel_soft_margin_loss():
    x = _rand(3, 5, grad=True)
    y = (torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    _check(F.multilabel_soft_margin_loss, x, y, grad=True)


def test_integer_power_negative_exponents():
    base = torch.tensor([-3, -2, -1, 0, 1, 2, 3, 6])
    exp = torch.tensor([-8, -3, -1, 0, 1, 2, 5, 40])
    for b, e in itertools.product((base, base.flip(0)), (exp, exp.flip(0))):
        _check(torch.pow, b, e)
    _check(lambda e: 6 ** e, exp)
    _check(lambda e: torch.pow(-1, e), exp)


def test_gcd_lcm_int64():
    a = torch.tensor([-4, 0, 0, 6, -9, 2 ** 40, 7])
    b = torch.tensor([6, 0, 5, -4, -6, 3 ** 20, -7])
    _check(torch.gcd, a, b)
    _check(torch.lcm, a, b)


def test_sgn_backward_is_zero():
    _check(torch.sgn, _rand(5, grad=True), grad=True)


# ---- indexing ----------------------------------------------------------------------------------

def test_put_and_index_put_accumulate_bool():
    x = torch.tensor([True, False, False, False, True, False])
    idx = torch.tensor([1, 1, 3, 0])
    src = torch.tensor([False, True, False, True])
    _check(lambda a, i, s: a.put(i, s, accumulate=True), x, idx, src)
    _check(lambda a, i, s: a.index_put((i,), s, accumulate=True), x, idx, src)
    _check(lambda a, i, s: a.index_add(0, i, s), x, idx, src)


def test_masked_select_broadcasts():
    x = _rand(4, 5, grad=True)
    m = torch.rand(5, generator=torch.Generator().manual_seed(2)) > 0.4
    _check(torch.masked_select, x, m, grad=True)
    _check(torch.masked_select, torch.arange(6), torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="expected BoolTensor"):
        torch.masked_select(x.detach().to(DEV), m.to(DEV).byte())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_unique_and_unique_consecutive(dtype):
    base = torch.tensor([[3., 1., float("nan"), 1.], [2., float("nan"), 3., 3.]])
    x = base.nan_to_num(7.0).to(dtype) if dtype != torch.float32 else base
    for s, inv, cnt in itertools.product((True, False), repeat=3):
        _check(lambda t: torch.unique(t, sorted=s, return_inverse=inv, return_counts=cnt), x)
    for inv, cnt in itertools.product((True, False), repeat=2):
        _check(lambda t: torch.unique_consecutive(t, return_inverse=inv, return_counts=cnt), x)
    _check(lambda t: torch.ops.aten._unique(t, True, True), x)
    _check(torch.unique, torch.zeros(0, dtype=dtype))
    _check(lambda t: torch.unique(t, return_inverse=True, return_counts=True), torch.tensor(5).to(dtype))


def test_index_fill_backward_native():
    x = _rand(4, 3, grad=True)
    _check(lambda t: t.index_fill(0, torch.tensor([1, 3, 1], device=t.device), 2.0), x, grad=True)


# ---- histograms, hashing -----------------------------------------------------------------------

def test_histogram():
    x = _rand(50) * 3
    w = _rand(50, seed=1).abs()
    _check(lambda t: torch.histogram(t, 7), x)
    _check(lambda t, u: torch.histogram(t, 5, range=(-1.0, 2.0), weight=u, density=True), x, w)
    _check(lambda t: torch.histogram(t, torch.tensor([-2.0, -0.5, 0.0, 1.0, 4.0], device=t.device)), x)
    _check(lambda t: torch.histogram(t, 3), torch.full((4,), 2.0))


def test_histogramdd():
    x = _rand(40, 3)
    _check(lambda t: torch.histogramdd(t, [2, 3, 4]), x)
    _check(lambda t: torch.histogramdd(t, [2, 2, 2], range=[-1.0, 1.0, -2.0, 2.0, 0.0, 1.0], density=True), x)
    edges = [torch.tensor([-2.0, 0.0, 2.0]), torch.tensor([-1.0, 1.0]), torch.tensor([-3.0, -1.0, 0.0, 3.0])]
    _check(lambda t: torch.histogramdd(t, [e.to(t.device) for e in edges]), x)
    with pytest.raises(RuntimeError, match="size of bins must be equal"):
        torch.histogramdd(x.to(DEV), [2, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_hash_tensor(dtype):
    x = (_rand(4, 6) * 10).to(dtype)
    _check(torch.hash_tensor, x)
    _check(lambda t: torch.hash_tensor(t, 1, keepdim=True), x)


# ---- normalization dtypes ----------------------------------------------------------------------

def test_layer_norm_and_batch_norm_saved_stats_dtype_bf16():
    x = _rand(3, 4, 5, dtype=torch.bfloat16)
    w, b = _rand(5, dtype=torch.bfloat16, seed=1), _rand(5, dtype=torch.bfloat16, seed=2)
    _check(lambda t, u, v: torch.ops.aten.native_layer_norm(t, [5], u, v, 1e-5), x, w, b, rtol=1.6e-2, atol=1e-2)
    rm, rv = torch.zeros(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)
    _check(lambda t, m, v: torch.ops.aten._batch_norm_with_update(t, None, None, m, v, 0.1, 1e-5)[:3],
           x, rm, rv, rtol=1.6e-2, atol=1e-2)


# ---- grid sampling, antialiased upsampling ---------------------------------------------------------

# Every mode once (bilinear and nearest with every padding); the rest runs in the slow target.
@pytest.mark.parametrize("mode,padding,align", [
    pytest.param(m, p, a, marks=[pytest.mark.slow] if (a == (p == "border")) or (m == "bicubic" and p != "zeros") else [])
    for m in ("bilinear", "nearest", "bicubic") for p in ("zeros", "border", "reflection")
    for a in (False, True)])
def test_grid_sample_2d(mode, padding, align):
    x = _rand(2, 3, 5, 6, grad=True)
    grid = (_rand(2, 4, 7, 2, seed=1) * 1.2).requires_grad_(True)
    _check(lambda t, g: F.grid_sample(t, g, mode=mode, padding_mode=padding, align_corners=align),
           x, grid, grad=True, rtol=1e-5, atol=1e-5)


# As for 2-D: every mode with every padding once here, the other alignment in the slow target.
@pytest.mark.parametrize("mode,padding,align", [
    pytest.param(m, p, a, marks=[pytest.mark.slow] if (a == (p == "border")) or (m == "bicubic" and p != "zeros") else [])
    for m in ("bilinear", "nearest") for p in ("zeros", "border", "reflection") for a in (False, True)])
def test_grid_sample_3d(mode, padding, align):
    x = _rand(2, 2, 4, 5, 3, grad=True)
    grid = (_rand(2, 3, 2, 4, 3, seed=1) * 1.2).requires_grad_(True)
    _check(lambda t, g: F.grid_sample(t, g, mode=mode, padding_mode=padding, align_corners=align),
           x, grid, grad=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size,align", [((3, 4), False), ((3, 4), True), ((9, 5), False), ((2, 11), True)])
def test_upsample_bilinear_antialias(size, align):
    x = _rand(2, 3, 7, 8, grad=True)
    _check(lambda t: F.interpolate(t, size=size, mode="bilinear", antialias=True, align_corners=align),
           x, grad=True, rtol=1e-5, atol=1e-5)
    _check(lambda t: F.interpolate(t, scale_factor=0.4, mode="bilinear", antialias=True), x, grad=True,
           rtol=1e-5, atol=1e-5)


# ---- losses' derivatives -------------------------------------------------------------------------

@pytest.mark.parametrize("p,reduction,weighted", [(1, "mean", False), (2, "sum", True), (1, "none", True)])
def test_multi_margin_loss_backward(p, reduction, weighted):
    x = _rand(4, 5, grad=True)
    t = torch.tensor([0, 4, 2, 2])
    w = _rand(5, seed=3).abs() if weighted else None
    _check(lambda a: F.multi_margin_loss(a, t.to(a.device), p=p, margin=0.7,
                                         weight=None if w is None else w.to(a.device), reduction=reduction),
           x, grad=True)
    _check(lambda a: F.multi_margin_loss(a, torch.tensor(3, device=a.device), reduction=reduction), _rand(5, grad=True),
           grad=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss_backward(reduction):
    x = _rand(3, 5, grad=True)
    t = torch.tensor([[3, 0, -1, 1, 2], [4, 4, 1, -1, 0], [-1, 2, 3, 0, 1]])
    _check(lambda a: F.multilabel_margin_loss(a, t.to(a.device), reduction=reduction), x, grad=True)
    _check(lambda a: F.multilabel_margin_loss(a, torch.tensor([1, -1, 0, 0, 0], device=a.device),
                                              reduction=reduction), _rand(5, grad=True, seed=4), grad=True)
    _check(lambda a: torch.ops.aten.multilabel_margin_loss_forward(a, t.to(a.device), 0), x.detach())


# ---- linear algebra ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5, 5), (6, 3), (3, 6), (2, 4, 3)])
def test_geqrf(shape):
    _check(torch.geqrf, _rand(*shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("left,transpose", list(itertools.product((True, False), repeat=2)))
def test_ormqr(left, transpose):
    a, tau = torch.geqrf(_rand(5, 3))
    c = _rand(5, 4, seed=1) if left else _rand(4, 5, seed=1)
    _check(lambda u, v, w: torch.ormqr(u, v, w, left=left, transpose=transpose), a, tau, c.requires_grad_(True),
           grad=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction,bias", [("mean", True), ("sum", False), ("none", True)])
def test_chunked_linear_cross_entropy_values_and_grads(reduction, bias):
    from torch.nn import LinearCrossEntropyOptions
    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    b = torch.randn(6, requires_grad=True) if bias else None
    cls_weight = torch.rand(6)
    target = torch.randint(0, 6, (10,))
    target[3] = -100   # ignored

    def run(dev):
        xs, ws = _dev(x).to(dev), _dev(w).to(dev)
        xs, ws = xs.detach().requires_grad_(), ws.detach().requires_grad_()
        bs = b.detach().to(dev).requires_grad_() if bias else None
        out = F.linear_cross_entropy(xs, ws, target.to(dev), linear_bias=bs, weight=cls_weight.to(dev),
                                     reduction=reduction, options=LinearCrossEntropyOptions(batch_chunk_size=4))
        out.backward(torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape).to(dev))
        return [out.detach().cpu(), xs.grad.cpu(), ws.grad.cpu()] + ([bs.grad.cpu()] if bias else [])

    ref = run("cpu")
    met.clear_counters()
    got = run(DEV)
    for a, c in zip(got, ref):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    assert not _fallbacks()


def test_lax_ops_broadcast_their_operands():
    """complex and integer trunc division broadcast operands of different ranks."""
    from helpers import check_op, no_fallback
    g = torch.Generator().manual_seed(0)
    with no_fallback():
        check_op(torch.complex, torch.randn(5, 1, generator=g), torch.randn(5, generator=g))
        check_op(torch.polar, torch.rand(5, 1, generator=g), torch.randn(3, generator=g))
        a, b = torch.randint(-9, 9, (5, 1), generator=g), torch.randint(1, 5, (4,), generator=g)
        check_op(lambda x, y: torch.div(x, y, rounding_mode="trunc"), a, b)
        check_op(lambda x, y: torch.div(x, y, rounding_mode="trunc"), b, a.abs() + 1)


@pytest.mark.parametrize("fn", [lambda t: torch.log_softmax(t, -1), lambda t: torch.softmax(t, 1),
                                lambda t: torch.logsumexp(t, -1), lambda t: F.softmin(t, -1)])
def test_reductions_over_empty_axis_with_empty_result(fn):
    """Results with no element compute nothing (a max over an empty axis has no identity)."""
    from helpers import check_op, no_fallback
    with no_fallback():
        check_op(fn, torch.randn(5, 0, 0))


def test_amax_over_empty_axis_still_refused():
    x = torch.randn(5, 0, 0)
    with pytest.raises(IndexError, match="non-zero size"):
        torch.amax(x, -1)
    with pytest.raises(IndexError, match="non-zero size"):
        torch.amax(x.to(DEV), -1)
