"""Reductions, scans, softmax and sorting against eager PyTorch on the CPU."""
import math
import re

import pytest
import torch

import torch_xla  # noqa: F401  (registers the xla device)

from helpers import XLA, assert_same, check_flat, no_fallback

# Ops other families lower (the backward of max.dim/sort/topk scatters, cummax's uses
# scatter_add, cumprod's gathers): their fallback is not a failure of these lowerings.
OTHERS = {"aten::scatter", "aten::scatter_add", "aten::gather", "aten::zero_", "aten::index_fill_",
          "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::_local_scalar_dense",
          "aten::new_zeros", "aten::masked_fill_"}


def check(fn, *args, grad=False, allow=None, rtol=1.3e-6, atol=1e-5):
    return check_flat(fn, *args, grad=grad, allow=allow, others=OTHERS, rtol=rtol, atol=atol)


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-5, 6, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def distinct(*shape, seed=0):
    """Values with no ties (for ops whose index of equal elements is unspecified)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    return (torch.randperm(n, generator=g).float() / 4 - n / 8).reshape(shape)


# ---- sum / mean / prod --------------------------------------------------------------------

def test_sum_mean_prod_shapes():
    xs = [rnd(), rnd(5), rnd(3, 4), rnd(2, 3, 4)]
    check(lambda *a: [(t.sum(), t.mean(), t.prod()) for t in a], *xs, grad=True, rtol=1e-5)


def test_sum_mean_dims():
    dims = [(0, False), (-1, True), ((0, 2), False), ((1, -1), True), ((), False), (None, False)]
    check(lambda a: [(a.sum(d, keepdim=k), a.mean(d, keepdim=k)) for d, k in dims] + [a.prod(1), a.prod(0, True)],
          rnd(2, 3, 4), grad=True, rtol=1e-5)


def test_sum_int_promotes():
    dtypes = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64]
    xs = [rnd(3, 4, dtype=d) for d in dtypes]
    out = check(lambda *xs: [(a.sum(), a.sum(1), a.sum(0, keepdim=True), a.prod(1), a.prod(),
                              a.sum(dtype=torch.float32), a.cumsum(0), a.cumprod(1), a.nansum(0)) for a in xs], *xs)[0]
    for i, d in enumerate(dtypes[:-1]):
        assert out[9 * i].dtype == torch.int64


def test_sum_dtype_arg_large_int_bf16():
    x = rnd(4, 6)
    big = torch.full((4, 3), 2 ** 31 - 1, dtype=torch.int32)
    check(lambda a, b: (a.sum(1, dtype=torch.float64), a.mean(0, dtype=torch.float64),
                        torch.sum(a, dtype=torch.float64), b.sum(), b.sum(0), b.cumsum(0)), x, big)
    xb = rnd(8, 16, dtype=torch.bfloat16)
    # (0-d bf16 results are reshaped: the engine's bf16 host copy turns 0-d into shape [1])
    check(lambda a: (a.sum().reshape(1), a.sum(1), a.mean(0), a.prod(0), a.cumsum(1)), xb, rtol=1e-2, atol=1e-2)


def test_prod_with_zero_and_nansum():
    x = rnd(3, 4)
    x[1, 2] = 0
    check(lambda a: (a.prod(1), a.prod()), x, grad=True, rtol=1e-5)
    x[0, 1] = float("nan")
    check(lambda a: (a.nansum(), a.nansum(1), torch.nansum(a, (0, 1), keepdim=True)), x)


# ---- max / min ---------------------------------------------------------------------------

def test_amax_amin_max_min_dtypes():
    xs = [rnd(3, 4, 5, dtype=d) for d in (torch.float32, torch.int64, torch.bool, torch.int32)]
    check(lambda *xs: [(a.amax(), a.amin(1), a.amax((0, 2), keepdim=True), a.max(), a.min(),
                        a.amin(-1, keepdim=True)) for a in xs], *xs)


def test_max_min_dim_indices_first():
    x = torch.tensor([[1., 3, 3, 2], [5, 5, 1, 5], [0, 0, 0, 0]])
    check(lambda a, b: (a.max(1), a.min(1), a.max(0, keepdim=True), a.argmax(1), a.argmin(0),
                        a.argmax(), a.argmin(), a.argmax(1, keepdim=True),
                        b.max(1), b.min(0), b.argmax(0), b.argmin(1, keepdim=True)), x, rnd(3, 4, dtype=torch.int64))


def test_max_min_nan_propagation():
    x = torch.tensor([[1., float("nan"), 3, float("nan")], [1, 2, 3, 4], [float("nan"), 0, 0, -1]])
    y = rnd(3, 4)
    check(lambda a, b: (a.max(), a.min(), a.amax(1), a.amin(0), a.max(1), a.min(1), a.argmax(1), a.argmin(1),
                        a.aminmax(dim=1), torch.max(a, b), torch.min(b, a)), x, y)


def test_max_min_grad():
    x = distinct(3, 4)
    check(lambda a: (a.max(1)[0], a.min(0, keepdim=True)[0], a.amax(1), a.amin(0), a.max(), a.min()), x, grad=True)


def test_scalar_tensor_dim_ops():
    check(lambda a: (a.max(0), a.argmax(0), a.amax(0), a.max(), a.argmax(), a.cummax(0), a.sort(0), a.sum(0),
                     a.median(0), a.kthvalue(1, 0), a.topk(1), a.var(0), a.logsumexp(0), a.softmax(0)),
          torch.tensor(3.))


def test_aminmax():
    check(lambda a, b: [torch.aminmax(t, dim=d, keepdim=k) for t in (a, b)
                        for d, k in ((None, False), (1, False), (0, True))],
          rnd(3, 4), rnd(3, 4, dtype=torch.int64))


# ---- var / std -----------------------------------------------------------------------------

def test_var_std():
    check(lambda a: [(torch.var(a, d, correction=c), torch.std(a, d, correction=c, keepdim=True),
                      torch.var_mean(a, d, correction=c), torch.std_mean(a, d, correction=c, keepdim=True))
                     for d in (None, 0, (0, 2), -1) for c in (0, 1, 2)],
          rnd(3, 4, 5), grad=True, rtol=1e-5, atol=1e-5)


def test_var_kwargs_degenerate_bf16():
    check(lambda a, b: (a.var(1, unbiased=False), a.std(0, unbiased=True), a.var(), a.std(1, correction=0.5),
                        b.var(1), b.std(), b.var(0, correction=2)), rnd(4, 3), rnd(1, 2))
    check(lambda a: (a.var(1), a.std(0), torch.var_mean(a, 1)), rnd(4, 16, dtype=torch.bfloat16),
          rtol=1e-2, atol=1e-2)


# ---- logsumexp, all/any, count_nonzero ------------------------------------------------------------

def test_logsumexp():
    x = rnd(3, 4, 5) * 10
    check(lambda a: (a.logsumexp(1), a.logsumexp((0, 2), keepdim=True), a.logsumexp(-1)), x, grad=True, rtol=1e-5)
    y = torch.tensor([[float("-inf"), float("-inf")], [float("inf"), 1.0], [1000., 1000.]])
    check(lambda a, b: (a.logsumexp(1), b.logsumexp(1)), y, rnd(3, 4, dtype=torch.int64))


def test_all_any():
    xs = [rnd(3, 4, dtype=d) for d in (torch.bool, torch.float32, torch.int64, torch.uint8)]
    for x in xs:
        x[0] = 1
        if x.dtype != torch.bool:
            x[1, 2] = 0
    check(lambda *xs: [(a.all(), a.any(), a.all(1), a.any(0, keepdim=True), torch.all(a, dim=(0, 1)),
                        torch.any(a, dim=()), torch.any(a, dim=(1,), keepdim=True), (a == 7).any()) for a in xs], *xs)


def test_count_nonzero():
    x = rnd(3, 4, 5)
    x[x.abs() < 0.5] = 0
    check(lambda a, b: (a.count_nonzero(), a.count_nonzero(1), a.count_nonzero((0, 2)), torch.count_nonzero(a, ()),
                        b.count_nonzero(0)), x, rnd(3, 4, dtype=torch.bool))


# ---- norms --------------------------------------------------------------------------------------

def test_vector_norm():
    x = rnd(3, 4)
    x[0, 0] = 0
    ps = [2, 1, 3, 0.5, float("inf"), float("-inf")]
    check(lambda a: [(torch.linalg.vector_norm(a, p), torch.linalg.vector_norm(a, p, dim=1),
                      torch.linalg.vector_norm(a, p, dim=(0, 1), keepdim=True)) for p in ps],
          x, grad=True, rtol=1e-5, atol=1e-5)
    check(lambda a: (torch.linalg.vector_norm(a, 0), torch.linalg.vector_norm(a, 0, dim=0)), x)


def test_norm_variants():
    x = rnd(3, 4)
    check(lambda a: (a.norm(), a.norm(dim=1), a.norm(p=1, dim=0, keepdim=True), a.norm(3),
                     torch.linalg.norm(a), torch.linalg.vector_norm(a, dtype=torch.float64),
                     torch.ops.aten.norm.Scalar(a, 3), torch.ops.aten.norm.ScalarOpt_dim(a, None, [1])),
          x, grad=True, rtol=1e-5)
    check(lambda a: (a.norm().reshape(1), torch.linalg.vector_norm(a, 3, dim=1)), rnd(4, 8, dtype=torch.bfloat16),
          rtol=1e-2, atol=1e-2)


def test_renorm():
    check(lambda a: (a.renorm(2, 0, 1.0), a.renorm(1, 1, 2.0), a.renorm(float("inf"), 0, 0.5)), rnd(3, 4) * 2,
          grad=True, rtol=1e-5)


# ---- scans -----------------------------------------------------------------------------------------

def test_cumsum_cumprod():
    x = rnd(3, 4) * 0.9
    check(lambda a: [(a.cumsum(d), a.cumprod(d)) for d in (0, 1, -1)] + [a.cumsum(0, dtype=torch.float64)],
          x, grad=True, rtol=1e-5)


def test_cumsum_scalar_and_int():
    check(lambda a, b, c: (a.cumsum(0), a.cumprod(-1), a.logcumsumexp(0), b.cumsum(1), b.cumprod(0), c.cumsum(0)),
          torch.tensor(1.5), rnd(3, 4, dtype=torch.int32), rnd(6, dtype=torch.bool))


def test_logcumsumexp():
    x = rnd(3, 5) * 5
    check(lambda a: (a.logcumsumexp(1), a.logcumsumexp(0)), x, grad=True, rtol=1e-5)
    y = torch.tensor([float("-inf"), 1., float("-inf"), 1000., 3.])
    check(lambda a: a.logcumsumexp(0), y)


def test_cummax_cummin():
    x = torch.tensor([[1., 3, 3, 2, float("nan"), 5, float("nan"), 7],
                      [4., 4, 1, 0, 0, 8, 8, -1]])
    check(lambda a, b, c: (a.cummax(1), a.cummin(1), a.cummax(0), a.cummin(0), b.cummax(1), b.cummin(0),
                           c.cummax(0), c.cummin(0)),
          x, rnd(3, 6, dtype=torch.int64), rnd(7, dtype=torch.bool))


def test_cummax_grad():
    check(lambda a: (a.cummax(1)[0], a.cummin(0)[0]), distinct(3, 5), grad=True)


# ---- softmax -------------------------------------------------------------------------------------

def test_softmax():
    check(lambda a: [(a.softmax(d), a.log_softmax(d)) for d in (0, 1, -1)], rnd(2, 3, 4) * 3, grad=True, rtol=1e-5)


def test_softmax_special():
    x = torch.tensor([[float("-inf"), 0., 1.], [1000., 1000., -1000.]])
    check(lambda a, b: (a.softmax(1), a.log_softmax(1), b.softmax(0), b.log_softmax(0)), x, torch.tensor(2.))
    check(lambda a: (a.softmax(1), a.log_softmax(1), torch.softmax(a, 1, dtype=torch.float32)),
          rnd(3, 8, dtype=torch.bfloat16), rtol=1e-2, atol=1e-2)
    check(lambda a: (a.softmax(1), a.log_softmax(0)), rnd(3, 8, dtype=torch.float64), grad=True)


# ---- sorting and selection ---------------------------------------------------------------------------

def test_sort_distinct():
    check(lambda a: [(a.sort(d, descending=s), a.argsort(d, descending=s)) for d in (0, -1) for s in (False, True)],
          distinct(4, 5))


def test_sort_grad():
    check(lambda a: (a.sort(1)[0], a.sort(0, descending=True)[0]), distinct(3, 4), grad=True)


def test_sort_stable_ties():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (3, 40), generator=g)
    xs = [x.float(), x, x > 0]
    xs[0][0, 5] = float("nan")
    xs[0][1, 7] = -0.0
    xs[0][2, ::7] = float("nan")
    check(lambda *xs: [(torch.sort(a, dim=1, descending=s, stable=True),
                        torch.argsort(a, dim=1, descending=s, stable=True),
                        torch.sort(a, dim=0, descending=s, stable=True)) for a in xs for s in (False, True)], *xs)


def test_topk():
    x = distinct(4, 6)
    check(lambda a, b: [(a.topk(3, largest=l), a.topk(2, dim=0, largest=l), a.topk(6, largest=l),
                         b.topk(2, largest=l)) for l in (True, False)],
          x, rnd(3, 5, dtype=torch.int64) * 100 + torch.arange(5))
    check(lambda a: (a.topk(2)[0], a.topk(2, dim=0, largest=False)[0]), x, grad=True)


def test_topk_unsorted_and_nan():
    x = distinct(3, 6)
    with no_fallback():
        xv, xi = x.to(XLA).topk(3, sorted=False)
        cv, ci = x.topk(3, sorted=False)
        assert_same(xv.sort(1)[0], cv.sort(1)[0])
    y = torch.tensor([[1., float("nan"), 3., 2.]])
    check(lambda a: (a.topk(2), a.topk(2, largest=False)), y)


def test_kthvalue_median():
    x = distinct(3, 5)
    check(lambda a, b: (a.kthvalue(2, 1), a.kthvalue(1, 0, keepdim=True), a.median(), a.median(1),
                        a.median(0, keepdim=True), a.nanmedian(), a.nanmedian(1),
                        b.kthvalue(3, 1), b.median(1), b.median()),
          x, rnd(3, 6, dtype=torch.int64) * 10 + torch.arange(6))
    check(lambda a: (a.kthvalue(2, 1)[0], a.median(0)[0], a.median()), x, grad=True)


def test_median_nan():
    x = torch.tensor([[1., float("nan"), float("nan"), 2.], [4., 3., 1., 2.], [float("nan")] * 4,
                      [5., float("nan"), 1., 3.]])
    # (the index nanmedian returns for an all-NaN slice is unspecified: not compared)
    check(lambda a, b: (a.median(1), a.median(), a.nanmedian(1)[0], a[[0, 1, 3]].nanmedian(1), a.nanmedian(),
                        b.median(), b.nanmedian()), x, torch.tensor([3., 1., 2., 5.]),
          allow={"aten::index"})


def test_mode():
    x = torch.tensor([[3., 1, 3, 1, 2, 2, 5], [1, 3, 3, 1, 2, 0, 0], [7, 6, 5, 4, 3, 2, 1]])
    check(lambda a, b, c: (a.mode(1), a.mode(0), a.mode(1, keepdim=True), b.mode(1), c.mode(0)),
          x, rnd(4, 9, dtype=torch.int64), rnd(9, dtype=torch.bool))


def test_segment_reduce():
    data = rnd(2, 7, 3)
    data[0, 1, 0] = 0.  # prod's gradient with a zero in the segment
    lengths = torch.tensor([[2, 0, 3, 2], [1, 1, 2, 3]])
    offsets = torch.cat([torch.zeros(2, 1, dtype=torch.long), lengths.cumsum(1)], 1)
    for reduce in ("max", "min", "mean", "sum", "prod"):
        for initial in (None, 2.):
            check(lambda d: torch.segment_reduce(d, reduce, lengths=lengths.to(d.device), axis=1, initial=initial),
                  data, grad=True, rtol=1e-5)
        check(lambda d: torch.segment_reduce(d, reduce, offsets=offsets.to(d.device), axis=1), data, grad=True,
              rtol=1e-5)


def test_ctc_loss():
    g = torch.Generator().manual_seed(0)
    t, n, c = 12, 3, 5
    logits = torch.randn(t, n, c, generator=g)
    targets = torch.randint(1, c, (n, 4), generator=g)
    targets[0, 1] = targets[0, 0]  # a repeated label (no skip transition between them)
    il, tl = [12, 9, 12], [4, 2, 3]
    F = torch.nn.functional
    for reduction in ("none", "mean", "sum"):
        check(lambda x: F.ctc_loss(x.log_softmax(2), targets, il, tl, reduction=reduction), logits, grad=True,
              rtol=1e-4, atol=1e-5)
    # concatenated targets, log_probs as the leaf (PyTorch's gradient convention), an
    # impossible alignment (input shorter than the targets need) zeroed by zero_infinity
    flat = torch.cat([targets[0, :4], targets[1, :2], targets[2, :3]])
    check(lambda x: F.ctc_loss(x, flat, [12, 2, 12], tl, reduction="none", zero_infinity=True),
          logits.log_softmax(2), grad=True, rtol=1e-4, atol=1e-5)


def test_max_min_of_no_elements_raise_as_on_cpu():
    a = torch.rand(2, 0, 4)
    xa = a.to("xla")
    cases = [lambda t: torch.max(t, dim=1), lambda t: torch.max(t), lambda t: torch.min(t, -2),
             lambda t: torch.min(t), lambda t: torch.amax(t, 1), lambda t: torch.amin(t, -2),
             lambda t: torch.amax(t)]
    for f in cases:
        with pytest.raises(Exception) as cpu:
            f(a)
        with pytest.raises(type(cpu.value), match=re.escape(str(cpu.value))):
            f(xa)
    for f in (lambda t: torch.max(t, 0).values, lambda t: torch.amin(t, (0, 2))):
        assert f(xa).cpu().shape == f(a).shape
