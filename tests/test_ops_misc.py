"""Ops whose generic PyTorch kernels write through views (so they need direct lowerings)."""
import torch
import torch_xla.debug.metrics as met

from helpers import check_op


def _no_fallback():
    return [c for c in met.counter_names() if c.startswith("aten::") and c != "aten::_local_scalar_dense"]


def test_block_diag_complex_polar_mvlgamma_sign():
    met.clear_all()
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[5.0, 6.0, 7.0]])
    check_op(lambda x, y, z: torch.block_diag(x, y, z), a, b, torch.tensor(3.0), grad=True)
    x, y = torch.randn(5), torch.randn(5)
    check_op(torch.complex, x, y)
    check_op(torch.polar, x.abs(), y)
    check_op(lambda t: torch.mvlgamma(t, 3), torch.rand(4) + 3, grad=True, rtol=1e-5)
    check_op(torch.sign, torch.tensor([True, False]))
    check_op(torch.sgn, torch.tensor([1 + 1j, 0j, -2 + 0.5j]))
    assert _no_fallback() == []


def test_sign_of_nan_is_zero():
    x = torch.tensor([float("nan"), -0.0, 0.0, 2.0, float("-inf"), -3.0])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        check_op(torch.sign, x.to(dtype))
        check_op(torch.sgn, x.to(dtype))


def test_ops_served_by_torch_decompositions():
    """Ops without a lowering of their own run their torch._decomp decomposition on the
    device (counted as decomposed::<op>), never the CPU."""
    from helpers import check_flat
    import torch.nn.functional as F
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    y, idx = F.max_pool2d(x, 2, return_indices=True)
    check_flat(lambda v, i: F.max_unpool2d(v, i, 2), y, idx, grad=True)
    assert met.counter_value("decomposed::max_unpool2d") > 0
    check_flat(lambda a, b: torch.ops.aten._chunk_cat([a, b], 1, 2), torch.randn(3, 4), torch.randn(3, 6))
    check_flat(lambda a, g: F.grid_sample(a, g, align_corners=False), x, torch.rand(2, 3, 3, 2) * 2 - 1,
               allow=("aten::grid_sampler_2d_backward",), rtol=1e-5, atol=1e-5)
    check_flat(lambda a: F.channel_shuffle(a, 3), torch.randn(2, 6, 2), grad=True)
    check_flat(lambda a: (torch.logspace(0, 2, 5), torch.rot90(a, 1, (0, 1)), F.celu(a, 0.5),
                          torch.dist(a, a.flip(0), 3)), torch.randn(3, 3), grad=True, rtol=1e-5)
    check_flat(lambda a, w: F.bilinear(a, a[:, :2], w), torch.randn(4, 3), torch.randn(5, 3, 2),
               grad=True, rtol=1e-5)


def test_native_batch_norm_saved_statistics_like_cpu():
    """Eval mode returns empty saved statistics; their dtype is the running stats' dtype."""
    from helpers import check_flat
    aten = torch.ops.aten
    x = torch.randn(3, 2, 4)
    for training in (True, False):
        for dt in (torch.float32, torch.bfloat16):
            check_flat(lambda a, m, v: aten.native_batch_norm(a, None, None, m, v, training, 0.1, 1e-5)[1:],
                       x.to(dt), torch.zeros(2, dtype=dt), torch.ones(2, dtype=dt), rtol=2e-2, atol=2e-2)


def test_equal_and_ctc_loss_with_tensor_lengths():
    """torch.equal returns a Python bool read from the device; CTC with tensor lengths
    reads the lengths once and runs on the device."""
    from helpers import XLA, check_flat
    import torch.nn.functional as F
    a = torch.randn(3, 4)
    for b in (a.clone(), a + 1, a[:2]):
        assert torch.equal(a.to(XLA), b.to(XLA)) == torch.equal(a, b)
    torch.manual_seed(0)
    lp = torch.randn(12, 2, 5).log_softmax(-1)
    tg = torch.randint(1, 5, (2, 4))
    il, tl = torch.tensor([12, 10]), torch.tensor([4, 3])
    check_flat(lambda x, t, i, l: F.ctc_loss(x, t, i, l), lp, tg, il, tl, grad=True,
               allow=("aten::_local_scalar_dense",), rtol=1e-5, atol=1e-5)


def test_arange_of_a_non_finite_bound_raises_as_on_cpu():
    import re
    import pytest
    for args in [(-5, float("nan")), (float("nan"), 5), (0, float("inf")), (float("nan"),), (5, 1)]:
        with pytest.raises(RuntimeError) as cpu:
            torch.arange(*args)
        with pytest.raises(RuntimeError, match=re.escape(str(cpu.value))):
            torch.arange(*args, device="xla")
    assert torch.arange(0, 1, 0.25, device="xla").cpu().tolist() == [0.0, 0.25, 0.5, 0.75]


def test_flip_errors_and_scalars_as_on_cpu():
    import pytest
    x = torch.arange(8).view(2, 2, 2)
    for dims in [(0, 1, 1), (0, -2, 1), (5, 1, 1), (1, 1, 5)]:
        with pytest.raises(Exception) as cpu:
            x.flip(dims)
        with pytest.raises(type(cpu.value)) as xla:
            x.to("xla").flip(dims)
        # the CPU's message, as the message or as the note under PyTorch/XLA's wording
        assert str(cpu.value) in "\n".join([str(xla.value)] + getattr(xla.value, "__notes__", []))
    check_op(lambda t: t.flip((2, 0)), x)
    check_op(lambda t: t.flip(0), torch.tensor(3.0))
