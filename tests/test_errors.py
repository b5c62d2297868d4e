"""Bad input raises the same exception as eager PyTorch on the CPU, at the op's line.

Each bad op is first run on CPU tensors to learn torch's own exception type; then the same
op on xla tensors must raise exactly that type inside a `pytest.raises` around the single op
call, before any barrier (a lazy engine that only failed at `xm.mark_step()` would fail
these tests with DID NOT RAISE).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xla  # noqa: F401  (registers the xla device)
import torch_xla.core.xla_model as xm
from torch_xla._engine.kernels.messages import XlaIndexError


def _xla():
    return xm.xla_device()


def _cpu_error(fn, *args):
    with pytest.raises(Exception) as ei:
        fn(*args)
    return ei.value


def _same_type(err, cerr):
    """`err` (xla) has the type of `cerr` (CPU); an op's IndexError is XlaIndexError, also
    a RuntimeError (PyTorch/XLA's type); a view's (checked by functionalization) is plain."""
    if type(cerr) is IndexError:
        return type(err) in (IndexError, XlaIndexError)
    return type(err) is type(cerr)


def _check_same_error(fn, *cpu_args, lazy=False):
    """fn raises the same exception type on xla copies of the args, at the call."""
    cerr = _cpu_error(fn, *cpu_args)
    if lazy:
        # inputs with pending IR (not yet materialised), as in a real training step
        xargs = [a.to(_xla()) * 1 if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else (a.to(_xla()) + 0 if isinstance(a, torch.Tensor) else a) for a in cpu_args]
    else:
        xargs = [a.to(_xla()) if isinstance(a, torch.Tensor) else a for a in cpu_args]
    with pytest.raises(Exception) as ei:
        fn(*xargs)
    assert _same_type(ei.value, cerr), (
        f"xla raised {type(ei.value).__name__}: {ei.value}\nCPU raised {type(cerr).__name__}: {cerr}")
    assert str(ei.value)
    # the failed op leaves no broken pending graph behind
    xm.mark_step()
    ok = (torch.ones(2, device=_xla()) * 3).sum()
    xm.mark_step()
    assert ok.item() == 6.0
    return ei.value, cerr


LAZY = pytest.mark.parametrize("lazy", [False, True], ids=["data", "pending"])


@LAZY
def test_add_broadcast_mismatch(lazy):
    _check_same_error(lambda a, b: a + b, torch.randn(2, 3), torch.randn(4, 3), lazy=lazy)


@LAZY
def test_inplace_add_broadcast_mismatch(lazy):
    _check_same_error(lambda a, b: a.add_(b), torch.randn(2, 3), torch.randn(2, 4), lazy=lazy)


@LAZY
def test_inplace_result_cannot_broadcast_to_self(lazy):
    _check_same_error(lambda a, b: a.mul_(b), torch.randn(1, 3), torch.randn(2, 3), lazy=lazy)


@LAZY
def test_matmul_inner_dim_mismatch(lazy):
    _check_same_error(lambda a, b: a @ b, torch.randn(2, 3), torch.randn(4, 5), lazy=lazy)
    _check_same_error(torch.mm, torch.randn(2, 3), torch.randn(4, 5), lazy=lazy)
    _check_same_error(torch.bmm, torch.randn(2, 2, 3), torch.randn(2, 4, 5), lazy=lazy)


@LAZY
def test_view_bad_size(lazy):
    _check_same_error(lambda a: a.view(7), torch.randn(2, 3), lazy=lazy)
    _check_same_error(lambda a: a.view(-1, 4), torch.randn(2, 3), lazy=lazy)
    _check_same_error(lambda a: a.reshape(5, -1), torch.randn(2, 3), lazy=lazy)


@LAZY
def test_cat_mismatched_dims(lazy):
    _check_same_error(lambda a, b: torch.cat([a, b], dim=0), torch.randn(2, 3), torch.randn(2, 4), lazy=lazy)
    _check_same_error(lambda a, b: torch.cat([a, b], dim=1), torch.randn(2, 3), torch.randn(2, 3, 1), lazy=lazy)


@LAZY
def test_conv_wrong_channel_count(lazy):
    conv_w = torch.randn(4, 3, 3, 3)
    _check_same_error(lambda x, w: F.conv2d(x, w), torch.randn(1, 2, 8, 8), conv_w, lazy=lazy)


def test_conv_module_wrong_channel_count():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 5, 8, 8)
    cerr = _cpu_error(conv, x)
    xconv = nn.Conv2d(3, 4, 3).to(_xla())
    xx = x.to(_xla())
    with pytest.raises(type(cerr)):
        xconv(xx)


def test_linear_wrong_in_features():
    lin = nn.Linear(3, 4)
    x = torch.randn(2, 5)
    cerr = _cpu_error(lin, x)
    xl = nn.Linear(3, 4).to(_xla())
    with pytest.raises(type(cerr)):
        xl(x.to(_xla()))


@LAZY
def test_index_out_of_range(lazy):
    _check_same_error(lambda a: a[5], torch.randn(3, 2), lazy=lazy)
    _check_same_error(lambda a: a.select(1, 2), torch.randn(3, 2), lazy=lazy)
    _check_same_error(lambda a: a.narrow(0, 2, 3), torch.randn(3, 2), lazy=lazy)


@LAZY
def test_dim_out_of_range(lazy):
    _check_same_error(lambda a: a.sum(dim=3), torch.randn(3, 2), lazy=lazy)
    _check_same_error(lambda a: a.transpose(0, 2), torch.randn(3, 2), lazy=lazy)
    _check_same_error(lambda a: torch.log_softmax(a, dim=2), torch.randn(3, 2), lazy=lazy)


@LAZY
def test_softmax_dim_out_of_range(lazy):
    _check_same_error(lambda a: torch.softmax(a, dim=-3), torch.randn(3, 2), lazy=lazy)


def test_expand_bad_size():
    _check_same_error(lambda a: a.expand(4, 3), torch.randn(2, 3))


def test_loss_target_shape_mismatch():
    _check_same_error(lambda a, t: F.mse_loss(a, t, reduction="none") + a,
                      torch.randn(2, 3), torch.randn(4, 3))
    _check_same_error(lambda a, t: F.nll_loss(a, t), torch.randn(4, 10), torch.randint(0, 10, (3,)))


def test_error_is_raised_before_barrier_in_a_pending_graph():
    """A long pending graph, then a bad op: raised at the op; the rest of the graph survives."""
    a = torch.randn(2, 3).to(_xla())
    b = (a * 2 + 1).sin()
    with pytest.raises(RuntimeError):
        b @ torch.randn(4, 5).to(_xla())
    c = b.sum()
    xm.mark_step()
    torch.testing.assert_close(c.cpu(), (a.cpu() * 2 + 1).sin().sum())


# ---------------------------------------------------------------------------------------
# device mismatch (under XLA_CPU_OPERAND=error; the default move is tests/test_cpu_operand.py)

@pytest.fixture
def cpu_operand_error():
    from torch_xla._engine import env_vars
    with env_vars.overlay({"XLA_CPU_OPERAND": "error"}):
        yield


@pytest.mark.usefixtures("cpu_operand_error")
def test_cpu_linear_given_xla_tensor():
    lin = nn.Linear(3, 4)
    x = torch.randn(2, 3).to(_xla())
    with pytest.raises(RuntimeError) as ei:
        lin(x)
    msg = str(ei.value)
    assert "xla" in msg and "cpu" in msg, msg


@pytest.mark.usefixtures("cpu_operand_error")
def test_xla_linear_given_cpu_tensor():
    lin = nn.Linear(3, 4).to(_xla())
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError) as ei:
        lin(x)
    msg = str(ei.value)
    assert "xla" in msg and "cpu" in msg, msg


@pytest.mark.usefixtures("cpu_operand_error")
def test_binary_op_cpu_and_xla_tensor():
    with pytest.raises(RuntimeError) as ei:
        torch.randn(2, 3).to(_xla()) + torch.randn(2, 3)
    msg = str(ei.value)
    assert "xla" in msg and "cpu" in msg, msg
    # a 0-d CPU tensor mixes in as a scalar, as with CUDA
    r = torch.ones(2, 3).to(_xla()) + torch.tensor(2.0)
    assert r.device.type == "xla"
    torch.testing.assert_close(r.cpu(), torch.full((2, 3), 3.0))


# ---------------------------------------------------------------------------------------
# unsupported dtypes

def _refused(fn, dtype):
    with pytest.raises((TypeError, RuntimeError)) as ei:
        fn()
    msg = str(ei.value)
    name = str(dtype)                 # e.g. "torch.complex32"
    assert name in msg or name.replace("torch.", "") in msg, msg
    return ei.value


@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.qint32])
def test_quantized_refused(dtype):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, dtype)
    _refused(lambda: q.to(_xla()), dtype)


# ---------------------------------------------------------------------------------------
# the precise wording: the CPU's exception type, PyTorch/XLA's message naming the shapes,
# PyTorch's own message kept as a note

_WORDED = [
    ("add", lambda a, b: torch.add(a, b), (torch.rand(2, 2, 4, 4), torch.rand(2, 2)),
     "Shapes are not compatible for broadcasting: f32[2,2,4,4] vs. f32[2,2]. Expected dimension 2 of "
     "shape f32[2,2,4,4] (4) to match dimension 0 of shape f32[2,2] (2). Either that or that any of "
     "them is either 1 or unbounded. Try reshaping one of the tensors to match the other."),
    ("cat", lambda a, b: torch.cat([a, b]), (torch.rand(2, 2), torch.rand(5, 1)),
     "cat(): cannot concatenate tensors of shape f32[2,2] with f32[5,1] at dimension 0. Expected "
     "shapes to be equal (except at dimension 0) or that either of them was a 1D empty tensor of size (0,)."),
    ("div", lambda a: torch.div(a, 2, rounding_mode="bad"), (torch.rand(2, 2),),
     "div(): invalid rounding mode `bad`. Expected it to be either 'trunc', 'floor', or be left unspecified."),
    ("flip", lambda a: torch.flip(a, dims=[0, 0, 0, 1, 2, 3, -1]), (torch.rand(2, 2, 2, 2),),
     "flip(): expected each dimension to appear at most once. Found dimensions: 0 (3 times), 3 (2 times). "
     "Consider changing dims from [0, 0, 0, 1, 2, 3, -1] to [0, 1, 2, 3]."),
    ("gather_rank", lambda a, i: torch.gather(a, 1, i), (torch.arange(4).view(2, 2), torch.zeros(2, 2, 2, dtype=torch.long)),
     "gather(): expected rank of input (2) and index (3) tensors to be the same."),
    ("gather_size", lambda a, i: torch.gather(a, 1, i),
     (torch.arange(16).view(2, 2, 2, 2), torch.zeros(4, 2, 4, 2, dtype=torch.long)),
     "gather(): expected sizes of index [4, 2, 4, 2] to be smaller or equal those of input [2, 2, 2, 2] "
     "on all dimensions, except on dimension 1. However, that's not true on dimensions [0, 2]."),
    ("random_empty", lambda a: a.random_(3, 1), (torch.empty(10),),
     "random_(): expected `from` (3) to be smaller than `to` (1)."),
    ("random_range", lambda a: a.random_(3, 65_506), (torch.empty(10, dtype=torch.float16),),
     "random_(): expected `to` to be within the range [-65504, 65504]. However got value 65505, which "
     "is greater than the upper bound."),
    ("mm_rank", torch.mm, (torch.rand(2, 2, 2), torch.rand(2, 2)),
     "mm(): expected the first input tensor f32[2,2,2] to be a matrix (i.e. a 2D tensor)."),
    ("mm_shape", torch.mm, (torch.rand(2, 5), torch.rand(8, 2)),
     "mm(): cannot matrix-multiply tensors f32[2,5] and f32[8,2]. Expected the size of dimension 1 of "
     "the first input tensor (5) to be equal the size of dimension 0 of the second input tensor (8)."),
    ("roll_empty", lambda a: torch.roll(a, []), (torch.rand(2, 2, 2),),
     "roll(): expected `shifts` to have at least 1 element."),
    ("roll_no_dims", lambda a: torch.roll(a, [2, 2]), (torch.rand(2, 2, 2),),
     "roll(): expected `shifts` [2, 2] (size=2) to have exactly 1 element when `dims` is empty."),
    ("roll_dims", lambda a: torch.roll(a, [2, 2], [0]), (torch.rand(2, 2, 2),),
     "roll(): expected `dims` [0] (size=1) to match the size of `shifts` [2, 2] (size=2)."),
    ("trace", torch.trace, (torch.rand(2, 2, 2),),
     "trace(): expected the input tensor f32[2,2,2] to be a matrix (i.e. a 2D tensor)."),
]


@pytest.mark.parametrize("name,fn,args,worded", _WORDED, ids=[w[0] for w in _WORDED])
def test_precise_wording_keeps_the_cpu_type(name, fn, args, worded):
    err, cerr = _check_same_error(fn, *[a.clone() for a in args])
    assert str(err) == worded
    assert "PyTorch's message: " in "\n".join(getattr(err, "__notes__", []))


def test_errors_the_wording_does_not_describe_keep_pytorchs_message():
    for fn, args in [(lambda a, b: torch.cat([a, b]), (torch.tensor(1.0), torch.rand(3))),
                     (lambda a: a.flip(5), (torch.rand(2, 2),))]:
        err, cerr = _check_same_error(fn, *args)
        assert not getattr(err, "__notes__", None), err


_F64 = torch.float64


@pytest.mark.parametrize("fn,args", [
    (torch.mm, (torch.rand(2, 3), torch.rand(3, 2, dtype=_F64))),
    (torch.matmul, (torch.rand(2, 3), torch.rand(3, 2, dtype=_F64))),
    (torch.mv, (torch.rand(2, 3), torch.rand(3, dtype=_F64))),
    (torch.addmm, (torch.rand(2, 2), torch.rand(2, 3), torch.rand(3, 2, dtype=_F64))),
    (torch.addmm, (torch.rand(2, 2, dtype=_F64), torch.rand(2, 3), torch.rand(3, 2, dtype=_F64))),
    (torch.addmv, (torch.rand(2), torch.rand(2, 3), torch.rand(3, dtype=_F64))),
    (F.linear, (torch.rand(2, 3), torch.rand(4, 3, dtype=_F64))),
    (F.linear, (torch.rand(2, 3), torch.rand(4, 3), torch.rand(4, dtype=_F64))),
], ids=["mm", "matmul", "mv", "addmm_self", "addmm_mat1", "addmv", "linear", "linear_bias"])
def test_matrix_products_refuse_mixed_dtypes_as_on_cpu(fn, args):
    """The CPU refuses float32 x float64 products (the meta kernels do not check it)."""
    err, cerr = _check_same_error(fn, *args)
    assert "same dtype" in str(err) and "same dtype" in str(cerr)


def test_full_negative_size_wording():
    with pytest.raises(RuntimeError) as cpu:
        torch.full([2, -2, 2], 1.5)
    with pytest.raises(type(cpu.value)) as ei:
        torch.full([2, -2, 2], 1.5, device=_xla())
    assert str(ei.value) == ("full(): expected concrete sizes (i.e. non-symbolic) to be positive values. "
                             "However found negative ones: [2, -2, 2].")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool])
@pytest.mark.parametrize("bounds", [(3, 1), (0, 0), (-5, 5), (0, 300), (-200, 0), (0, 65_506),
                                    (0, 2 ** 40), (2 ** 30, None), (-1, None), (-3,), (5,)])
def test_random_bounds_checked_as_on_cpu(dtype, bounds):
    """random_ refuses the bounds the CPU refuses (with its type), and draws within the
    ones it accepts."""
    try:
        torch.empty(4, dtype=dtype).random_(*bounds)
        cpu_err = None
    except Exception as e:
        cpu_err = e
    if cpu_err is not None:
        with pytest.raises(type(cpu_err)):
            torch.empty(4, dtype=dtype, device=_xla()).random_(*bounds)
        return
    r = torch.empty(1000, dtype=dtype, device=_xla()).random_(*bounds).cpu()
    lo = bounds[0] if len(bounds) == 2 else 0
    hi = bounds[-1]
    assert r.to(torch.float64).min() >= lo
    exact = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}.get(dtype)
    if hi is not None and (exact is None or hi <= exact):  # beyond: rounded (the CPU warns)
        assert r.to(torch.float64).max() < hi


@LAZY
@pytest.mark.parametrize("fn,args", [
    (lambda a: a.flip(3), (torch.rand(2, 2, 2),)),
    (lambda a: a.flip(0, 1, 2, 3), (torch.rand(2, 2, 2),)),
    (lambda a: a.sum(-3), (torch.rand(2, 2),)),
    (lambda a: torch.max(a, dim=1), (torch.rand(2, 0, 4),)),
    (lambda a: torch.min(a, dim=-2), (torch.rand(2, 0, 4),)),
    (lambda a: a.amax(1), (torch.rand(2, 0, 4),)),
    (lambda a: torch.softmax(a, 2), (torch.rand(2, 2),)),
    (lambda a: a.transpose(0, 2), (torch.rand(2, 2),)),
    (lambda a: a.select(0, 5), (torch.rand(2, 2),)),
    (lambda a: torch.unique(a, dim=3), (torch.rand(2, 2),)),
], ids=["flip", "flip_many", "sum", "max_empty", "min_empty", "amax_empty", "softmax", "transpose",
        "select", "unique_dim_cpu_fallback"])
def test_index_errors_are_also_runtime_errors(fn, args, lazy):
    """Where the CPU raises IndexError (a dimension or index out of range, a reduction over
    an empty dimension), the xla tensor's error is that IndexError with its message, and
    also the RuntimeError PyTorch/XLA raises; for ops taking the CPU fallback too."""
    err, cerr = _check_same_error(fn, *args, lazy=lazy)
    assert type(cerr) is IndexError
    assert isinstance(err, IndexError) and isinstance(err, RuntimeError)
    assert str(err) == str(cerr)
    with pytest.raises(RuntimeError):
        fn(*[a.to(_xla()) for a in args])
