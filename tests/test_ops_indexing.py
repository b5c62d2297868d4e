"""Indexing ops (forward and backward) against eager PyTorch on the CPU."""
import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met

from helpers import XLA, assert_same, check_op

# Counters that are not indexing ops: `zero_` is what new_zeros (used by the index and
# gather backward formulas) and Tensor.zero_() run below functionalization until a
# `zero`/`new_zeros` lowering exists (factories/fills, not this file's ops).
ALLOWED = ("aten::_local_scalar_dense", "aten::nonzero", "aten::zero_")


def _fallbacks():
    return [c for c in met.counter_names() if c.startswith("aten::") and c not in ALLOWED]


def pytest_configure(config):
    config.addinivalue_line("markers", "fallback_ok: the test expects CPU fallbacks")


@pytest.fixture(autouse=True)
def no_fallback(request):
    met.clear_counters()
    yield
    if "fallback_ok" not in request.keywords:
        assert not _fallbacks(), _fallbacks()


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


X = torch.randn(5, 6, 4, generator=_g())
I = torch.tensor([0, 2, -1, 2])        # with a negative and a duplicate
J = torch.tensor([[1, -2], [3, 0]])
T = torch.tensor


# Index tensors are passed as arguments: check_op moves them to the device.

# ---- index -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,idx", [
    (lambda x, i: x[i], (I,)),
    (lambda x, i: x[:, i], (I,)),
    (lambda x, i: x[:, :, i], (T([3, 0]),)),
    (lambda x, i: x[i], (J,)),
    (lambda x, i: x[i, i], (I,)),
    (lambda x, i: x[i, :, i], (I,)),            # non-adjacent: the index dims go first
    (lambda x, i: x[:, i, i], (J,)),
    (lambda x, i: x[i], (T([1, 0]).int(),)),
    (lambda x, i, j: x[i, j], (I.reshape(4, 1), T([0, 5]))),
    (lambda x, i: x[None, i], (I,)),
])
def test_index(fn, idx):
    check_op(fn, X, *idx, grad=True)


# Mixed with basic indexing (select/slice views).
@pytest.mark.parametrize("fn,idx", [
    (lambda x, i: x[i, 1], (J,)),
    (lambda x, i: x[i], (T(3),)),               # a 0-d index is a select
    (lambda x, i: x[None, i, 1:], (I,)),
    (lambda x, i: x[1:4, i][..., 2], (I,)),
    (lambda x, i: x[::2, i, 1:3], (T([[0], [5]]),)),
])
def test_index_mixed(fn, idx):
    check_op(fn, X, *idx, grad=True)


def test_index_int_tensor():
    check_op(lambda x, i: x[i], torch.arange(30).reshape(5, 6), I)


@pytest.mark.fallback_ok
def test_bool_mask_getitem_falls_back():
    # data-dependent shape: runs on the CPU fallback (aten::index), still correct
    check_op(lambda x: x[x > 0.3], X)
    check_op(lambda x, m: x[:, m], X, T([True, False, True, True, False, False]), grad=True)
    assert "aten::index" in met.counter_names()


# ---- index_put ---------------------------------------------------------------------------

def _put(x, idx, v):
    y = x.clone()
    y[idx] = v
    return y


def test_setitem():
    v1 = torch.randn(5, 4, 4, generator=_g(1))
    v2 = torch.randn(3, 6, generator=_g(2))
    v3 = torch.randn(4, generator=_g(3))
    v4 = torch.randn(6, 4, generator=_g(4))
    check_op(lambda x, i: _put(x, i, 1.5), X, I[:3], grad=True)
    check_op(lambda x, i, v: _put(x, (slice(None), i), v), X, I, v1, grad=True)
    check_op(lambda x, i, j, v: _put(x, (i, slice(None), j), v), X, I[:3], T([0, 1, 3]), v2, grad=True)
    check_op(lambda x, i, v: _put(x, i, v), X, J, v3, grad=True)          # broadcast values
    check_op(lambda x, i, v: _put(x, i, v), X, T(-2), v4, grad=True)   # a 0-d index: select + copy_
    check_op(lambda x, i: _put(x, i, 7), torch.arange(30).reshape(5, 6), I)


def test_index_put_accumulate():
    v = torch.randn(4, 6, 4, generator=_g(5))
    check_op(lambda x, i, v: x.index_put((i,), v, accumulate=True), X, I, v, grad=True)
    check_op(lambda x, i, v: torch.ops.aten.index_put(x, [None, i], v, True), X, T([1, 1, 5]),
             torch.randn(5, 3, 4, generator=_g(30)), grad=True)
    check_op(lambda x, i: x.clone().index_put_((i, i), torch.tensor(2.0, device=x.device), accumulate=True), X, I)
    check_op(lambda x, i: x.clone().index_put_((i,), torch.tensor([7], device=x.device), accumulate=True),
             torch.arange(20).reshape(4, 5), T([0, 3, 0]))


@pytest.mark.fallback_ok
def test_bool_mask_setitem():
    # Forward is lowered; the gradient of values is grad[mask] (aten::index with a bool
    # mask: data-dependent shape, CPU fallback).
    mask = X[:, :, 0] > 0
    n = int(mask.sum())
    check_op(lambda x, m: _put(x, m, -1.0), X, mask, grad=True)                        # scalar
    check_op(lambda x, m, v: _put(x, m, v), X, mask, torch.randn(4, generator=_g(6)), grad=True)  # broadcast
    check_op(lambda x, m, v: _put(x, m, v), X, mask, torch.randn(n, 4, generator=_g(7)), grad=True)  # count
    m3 = X > 0.5
    check_op(lambda x, m: x.index_put((m,), torch.tensor(3.0, device=x.device), accumulate=True), X, m3)
    check_op(lambda x, m, v: x.index_put((m,), v), X, m3, torch.randn(int(m3.sum()), generator=_g(8)))
    m1 = T([True, False, True, True, False, True])
    check_op(lambda x, m, v: torch.ops.aten.index_put(x, [None, m], v), X, m1, torch.randn(5, 4, 4, generator=_g(9)))
    check_op(lambda x, m, v: torch.ops.aten.index_put(x, [None, m], v, True), X, m1, torch.randn(4, generator=_g(9)))
    assert set(_fallbacks()) <= {"aten::index"}, _fallbacks()
    met.clear_counters()
    check_op(lambda x, m, v: _put(x, m, v), X, mask, torch.randn(n, 4, generator=_g(7)))
    assert not _fallbacks(), _fallbacks()


# ---- gather / scatter --------------------------------------------------------------------

G = T([[0, 3, 3], [5, 1, 0], [2, 2, 4]])
A = torch.randn(4, 6, generator=_g(10))


def test_gather():
    check_op(lambda x, i: torch.gather(x, 1, i), A, G, grad=True)
    check_op(lambda x, i: torch.gather(x, 0, i), A, T([[3, 0], [1, 1]]), grad=True)
    check_op(lambda x, i: torch.gather(x, -1, i), A, G[:2, :1], grad=True)
    check_op(lambda x, i: torch.gather(x, 0, i), torch.randn(5, generator=_g(11)), T(2), grad=True)
    check_op(lambda x, i: torch.gather(x, 1, i), torch.arange(24).reshape(4, 6), G)


def test_take_along_dim():
    check_op(lambda x: torch.take_along_dim(x, torch.argsort(x, dim=1), dim=1), A, grad=True)
    check_op(lambda x, i: torch.take_along_dim(x, i, dim=1), A, T([[0], [2], [5], [1]]), grad=True)
    check_op(lambda x, i: torch.take_along_dim(x, i), A, T([0, 23, 7]), grad=True)


def test_scatter():
    src = torch.randn(3, 4, generator=_g(13))
    idx = T([[0, 1, 2], [5, 4, 3], [1, 1, 1]])   # duplicates in the last row
    idx_u = T([[0, 1, 2], [5, 4, 3], [2, 3, 1]])
    check_op(lambda x, i, s: torch.scatter(x, 1, i, s), A, idx_u, src[:, :3], grad=True)
    check_op(lambda x, i: torch.scatter(x, 1, i, 2.5), A, idx_u, grad=True)
    check_op(lambda x, i, s: x.scatter(1, i, s, reduce="add"), A, idx, src)
    check_op(lambda x, i, s: x.scatter(1, i, s, reduce="multiply"), A, idx, src)
    check_op(lambda x, i: x.scatter(0, i, 4.0, reduce="add"), A, T([[3, 0, 1]]))
    check_op(lambda x, i: x.scatter(0, i, 4.0, reduce="multiply"), A, T([[3, 0, 1]]))
    check_op(lambda x, i, s: torch.scatter_add(x, 1, i, s), A, idx, src[:, :3], grad=True)
    check_op(lambda x, i, s: x.clone().scatter_add_(0, i, s), A, T([[1, 1], [1, 2]]), src[:2, :2])
    check_op(lambda x, i, s: x.clone().scatter_(1, i, s), A, idx_u, src)
    check_op(lambda x, i: x.scatter(1, i, 5), torch.zeros(4, 6, dtype=torch.int32), idx_u)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce(reduce, include_self):
    src = torch.randn(3, 5, generator=_g(15))
    idx = T([[0, 1, 1, 5, 0], [2, 2, 2, 2, 2], [3, 0, 4, 3, 1]])
    grad = reduce in ("sum", "mean")
    check_op(lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=include_self), A, idx, src, grad=grad)
    check_op(lambda x, i, s: x.scatter_reduce(0, i, s, reduce, include_self=include_self),
             A, idx[:, :2] % 4, src[:, :2])
    ai = torch.randint(-9, 9, (4, 6), generator=_g(16))
    si = torch.randint(-9, 9, (3, 5), generator=_g(17))
    check_op(lambda x, i, s: x.scatter_reduce(1, i, s, reduce, include_self=include_self), ai, idx, si)


# ---- index_select / index_add / index_copy / index_fill -----------------------------------

def test_index_select():
    check_op(lambda x, i: x.index_select(0, i), X, T([4, 0, 0, 2]), grad=True)
    check_op(lambda x, i: x.index_select(-1, i), X, T([3, 1]), grad=True)
    check_op(lambda x, i: x.index_select(1, i), X, T(5), grad=True)
    check_op(lambda x, i: torch.index_select(x, 0, i), torch.arange(6), T([1, 1]))


def test_index_add_copy_fill():
    a = torch.randn(5, 4, generator=_g(18))
    s = torch.randn(3, 4, generator=_g(19))
    i3 = T([4, 0, 4])
    check_op(lambda x, i, s: x.index_add(0, i, s), a, i3, s, grad=True)
    check_op(lambda x, i, s: x.index_add(0, i, s, alpha=-2.5), a, i3, s, grad=True)
    check_op(lambda x, i, s: x.index_add(1, i, s), a.T, T([3, 1, 3]), s.T, grad=True)
    check_op(lambda x, i, s: x.clone().index_add_(1, i, s), a, T([0, 0, 2]), torch.randn(5, 3, generator=_g(20)))
    check_op(lambda x, i, s: x.index_add(0, i, s, alpha=3), torch.arange(20).reshape(5, 4), i3,
             torch.ones(3, 4, dtype=torch.int64))
    check_op(lambda x, i, s: x.index_copy(0, i, s), a, T([4, 1, 0]), s, grad=True)
    check_op(lambda x, i, s: x.clone().index_copy_(1, i, s), a, T([3, 0]), torch.randn(5, 2, generator=_g(21)))
    check_op(lambda x, i: x.index_fill(1, i, -1.5), a, T([0, 3]), grad=True)
    check_op(lambda x, i: x.index_fill(0, i, 2.0), a, T([2]))
    check_op(lambda x, i: x.clone().index_fill_(0, i, torch.tensor(7.0, device=x.device)), a, T([1, 4]))
    check_op(lambda x, i: x.index_fill(-1, i, 5), torch.arange(12).reshape(3, 4), T([1]))


# ---- masked_scatter / take / put -------------------------------------------------------------

def test_masked_scatter():
    a = torch.randn(4, 5, generator=_g(22))
    m = torch.randn(4, 5, generator=_g(23)) > 0
    src = torch.randn(30, generator=_g(24))
    check_op(lambda x, m, s: x.masked_scatter(m, s), a, m, src, grad=True)
    check_op(lambda x, m, s: x.masked_scatter(m, s.reshape(5, 6)), a, m[0], src, grad=True)  # broadcast mask
    check_op(lambda x, m, s: x.clone().masked_scatter_(m, s), a, m, src)


def test_take_put():
    a = torch.randn(4, 5, generator=_g(25))
    idx = T([[0, 19], [-1, 7]])
    src = torch.randn(2, 2, generator=_g(26))
    check_op(lambda x, i: torch.take(x, i), a, idx, grad=True)
    check_op(lambda x, i, s: x.put(i, s), a, T([[3, -4], [0, 12]]), src, grad=True)
    check_op(lambda x, i, s: x.put(i, s.reshape(-1), accumulate=True), a, T([7, 19, 0, 7]), src, grad=True)
    check_op(lambda x, i, s: x.clone().put_(i, s, accumulate=True), torch.arange(6), T([1, 1]), T([3, 4]))


# ---- typical uses ------------------------------------------------------------------------------

def test_embedding_like_and_cross_entropy_gather():
    w = torch.randn(10, 3, generator=_g(27))
    check_op(lambda w, t: w[t].sum(-1), w, T([[1, 9, 9], [0, 4, -1]]), grad=True)
    logits = torch.randn(6, 10, generator=_g(28))
    check_op(lambda l, t: -torch.log_softmax(l, -1).gather(1, t[:, None]).squeeze(1), logits,
             T([1, 0, 9, 3, 3, 7]), grad=True, rtol=1e-5)


def test_no_recompile_with_new_index_values():
    a = torch.randn(6, 4, generator=_g(29))
    xa = a.to(XLA)
    torch_xla.sync()
    outs, compiles = [], []
    for k in range(3):
        idx = T([k, 5 - k, 2]).to(XLA)
        outs.append((xa * 2).index_add(0, idx, xa[idx]))
        torch_xla.sync()
        compiles.append(met.metric_data("CompileTime")[0])
    assert compiles[0] == compiles[1] == compiles[2], compiles
    for k, o in enumerate(outs):
        idx = T([k, 5 - k, 2])
        assert_same(o, (a * 2).index_add(0, idx, a[idx]))


def test_searchsorted_bucketize():
    g = torch.Generator().manual_seed(0)
    seq = torch.sort(torch.randn(2, 3, 7, generator=g)).values
    seq[0, 0, 3] = seq[0, 0, 2]  # a tie
    v = torch.randn(2, 3, 5, generator=g)
    v[0, 0, 0] = seq[0, 0, 2]
    v[1, 1, 1] = float("nan")  # NaN lands where the CPU's binary search puts it
    unsorted = torch.randn(2, 3, 7, generator=g)
    for right in (False, True):
        check_op(lambda s, x: torch.searchsorted(s, x, right=right), seq, v)
        check_op(lambda s, x: torch.searchsorted(s, x, right=right, out_int32=True), seq[0, 0], v)
        check_op(lambda s: torch.searchsorted(s, 0.25, right=right), seq[0, 0])
        check_op(lambda s, x, o: torch.searchsorted(s, x, side="right" if right else "left", sorter=o),
                 unsorted, v, unsorted.argsort(-1))
        check_op(lambda x, b: torch.bucketize(x, b, right=right), v, seq[0, 0])
    with pytest.raises(RuntimeError, match="boundaries tensor must be 1 dimension"):
        torch.bucketize(v.to(XLA), seq.to(XLA))


def test_index_reduce():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g)
    src = torch.randn(4, 6, generator=g)
    idx = torch.tensor([0, 2, 2, 4, 0, 0])
    for reduce in ("prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            check_op(lambda a, s: a.index_reduce(1, idx.to(a.device), s, reduce, include_self=include_self),
                     x, src, grad=reduce != "prod", rtol=1e-5)
    xi = torch.randint(-9, 9, (5, 3), generator=g)
    check_op(lambda a, s: a.index_reduce(0, torch.tensor([1, 1, 3], device=a.device), s, "mean"), xi,
             torch.randint(-9, 9, (3, 3), generator=g))


def test_nonzero_static_histc():
    x = torch.tensor([[0., 1.5, 0.], [2., 0., -1.]])
    for size in (0, 2, 3, 6):
        check_op(lambda a: torch.nonzero_static(a, size=size, fill_value=-7), x)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(50, generator=g) * 3
    check_op(lambda a: torch.histc(a, bins=7, min=-2, max=3), v)
    check_op(lambda a: torch.histc(a, bins=5), v)  # min == max: the data's range
    check_op(lambda a: torch.histc(a, bins=4), torch.full((3,), 2.))  # empty range: [1, 3]
    check_op(lambda a: torch.histc(a, bins=6, min=-1, max=2), v.bfloat16())


def test_embedding_bag():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 3, generator=g)
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0])
    off = torch.tensor([0, 3, 3, 7])
    psw = torch.rand(9, generator=g)
    F = torch.nn.functional
    for mode in ("sum", "mean", "max"):
        check_op(lambda wt: F.embedding_bag(idx.to(wt.device), wt, off.to(wt.device), mode=mode), w, grad=True)
        check_op(lambda wt: F.embedding_bag(idx.to(wt.device), wt, off.to(wt.device), mode=mode, padding_idx=4,
                                            scale_grad_by_freq=mode != "max"), w, grad=True)
        check_op(lambda wt: F.embedding_bag(idx[:8].reshape(2, 4).to(wt.device), wt, mode=mode), w, grad=True)
    check_op(lambda wt, p: F.embedding_bag(idx.to(wt.device), wt, torch.tensor([0, 3, 3, 7, 9], device=wt.device),
                                           per_sample_weights=p, include_last_offset=True, mode="sum"),
             w, psw, grad=True)
