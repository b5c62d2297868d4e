"""Half-precision dropout's 8-bit mask (compared with PyTorch's dropout semantics on the
CPU: zeros at rate p, the rest scaled by 1/(1-p)), and expand's shape errors worded as
PyTorch/XLA words them when XLA_DISABLE_FUNCTIONALIZATION is set."""
import pytest
import torch

import torch_xla


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.5, 0.25, 0.1])
def test_half_dropout_mask(dev, dtype, p):
    x = torch.rand(300, 200).to(dtype) + 1.0
    xx = x.to(dev).requires_grad_()
    y = torch.nn.functional.dropout(xx, p)
    text = torch_xla._XLAC._get_xla_tensors_hlo([y])
    exact = (1 - p) * 256 == int((1 - p) * 256)
    assert ("u8[" in text) == exact
    y.sum().backward()
    out, grad = y.detach().cpu(), xx.grad.cpu()
    kept = out != 0
    assert abs(1.0 - kept.float().mean().item() - p) < 0.02
    scale = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
    torch.testing.assert_close(out[kept], (x * scale)[kept])
    torch.testing.assert_close(grad, torch.where(kept, scale, torch.zeros((), dtype=dtype)).expand_as(grad))


def test_float_dropout_eval_and_extremes(dev):
    x = torch.rand(8, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.nn.functional.dropout(x.to(dev), 0.5, training=False).cpu(), x)
    torch.testing.assert_close(torch.nn.functional.dropout(x.to(dev), 1.0).cpu(), torch.zeros_like(x))
    torch.testing.assert_close(torch.nn.functional.dropout(x.to(dev), 0.0).cpu(), x)


@pytest.fixture
def no_functionalization(monkeypatch):
    from torch_xla._engine import env_vars
    monkeypatch.setenv("XLA_DISABLE_FUNCTIONALIZATION", "1")
    env_vars.reload()
    yield
    monkeypatch.delenv("XLA_DISABLE_FUNCTIONALIZATION")
    env_vars.reload()


@pytest.mark.parametrize("sizes,message", [
    ([-1, 3], "expand(): expected the `input` tensor f32[1,1,2,3] (rank: 4) to have a rank smaller or "
              "equal to the given `sizes` [-1, 3] (rank: 2)."),
    ([1, 1, 1, 3], "expand(): expected dimension 2 of the given `sizes` [1, 1, 1, 3] (1) to be -1, or equal "
                   "to the size of the `input` tensor f32[1,1,2,3] at dimension 2 (2)."),
    ([5, 2, 1, 3, 3], "expand(): expected dimension 3 of the given `sizes` [5, 2, 1, 3, 3] (3) to be -1, or "
                      "equal to the size of the `input` tensor f32[1,1,2,3] at dimension 2 (2)."),
])
def test_expand_wording_without_functionalization(dev, no_functionalization, sizes, message):
    a = torch.rand(1, 1, 2, 3, device=dev)
    with pytest.raises(RuntimeError):   # the CPU refuses it too
        torch.rand(1, 1, 2, 3).expand(sizes)
    with pytest.raises(RuntimeError) as e:
        a.expand(sizes)
    assert str(e.value) == message


def test_expand_wording_with_functionalization_is_pytorchs(dev):
    a = torch.rand(1, 1, 2, 3, device=dev)
    with pytest.raises(RuntimeError) as cpu:
        torch.rand(1, 1, 2, 3).expand([1, 1, 1, 3])
    with pytest.raises(RuntimeError) as xla:
        a.expand([1, 1, 1, 3])
    assert str(xla.value) == str(cpu.value)


def test_valid_expand_without_functionalization(dev, no_functionalization):
    a = torch.rand(1, 1, 2, 3)
    torch.testing.assert_close(a.to(dev).expand([4, -1, 1, 2, 3]).cpu(), a.expand([4, -1, 1, 2, 3]))
