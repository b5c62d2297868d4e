"""Programs that read placeholder tensors (device data without a buffer): printed as
PyTorch/XLA prints them, refused with a RuntimeError when run, without blocking the
other pending tensors. Values are compared with eager CPU."""
import re

import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla.core.xla_builder import create_placeholder_tensor

X = torch_xla._XLAC


@pytest.fixture(autouse=True)
def clean():
    torch_xla.sync()
    met.clear_all()


def test_ir_text_prints_shapes_with_layouts(dev):
    p1 = create_placeholder_tensor((2, 3), torch.bfloat16)
    p2 = create_placeholder_tensor((3, 4), torch.bfloat16)
    b = (torch.sin(p1) @ p2) @ p2.T
    text = X._get_xla_tensors_text([b])
    assert text.count("bf16[2,3]{1,0} xla::device_data()") == 1
    assert text.count("bf16[3,4]{1,0} xla::device_data()") == 1
    assert "bf16[2,3]{1,0} aten::mm(" in text
    s = torch.ones((), device=dev) + 1
    assert "f32[] aten::add" in X._get_xla_tensors_text([s])
    assert not met.metric_data("TransferToDeviceTime")


def test_hlo_parameters_in_the_originals_order_and_tuple_result():
    p1 = create_placeholder_tensor((2, 3), torch.bfloat16)
    p2 = create_placeholder_tensor((3, 4), torch.bfloat16)
    b = (torch.sin(p1) @ p2) @ p2.T
    hlo = X._get_xla_tensors_hlo([b])
    # the last operand's subtree is met first: p2 (through the transpose) is parameter 0
    assert re.search(r"ENTRY %\S+ \(p0\.\d+: bf16\[3,4\], p1\.\d+: bf16\[2,3\]\) -> \(bf16\[2,3\]\)", hlo), hlo
    assert "HloModule jit_fn" in hlo


def test_hlo_text_matches_the_program_run(dev):
    a, b = torch.randn(3, 4), torch.randn(4)
    xa, xb = a.to(dev), b.to(dev)
    y = xa - xb
    hlo = X._get_xla_tensors_hlo([y])
    # the printed parameters are numbered as the original numbers them (xb first); the
    # program run keeps its own order and computes the same value
    assert re.search(r"\(p0\.\d+: f32\[4\], p1\.\d+: f32\[3,4\]\) -> \(f32\[3,4\]\)", hlo), hlo
    torch.testing.assert_close(y.cpu(), a - b)


def test_running_a_placeholder_raises_runtime_error_naming_it(dev):
    p = create_placeholder_tensor((2, 3), torch.float32)
    b = torch.sin(p) + 1
    with pytest.raises(RuntimeError, match=r"placeholder f32\[2,3\] \(no device buffer\)"):
        b.cpu()
    with pytest.raises(RuntimeError, match="placeholder"):
        b.cpu()                     # still not computable
    torch_xla.sync()                # and no longer a root of the barrier


def test_failed_sync_computes_the_other_pending_tensors(dev):
    a = torch.randn(2, 3)
    x = a.to(dev)
    y = x * 2.0
    p = create_placeholder_tensor((2, 3), torch.float32)
    b = p + x
    with pytest.raises(RuntimeError, match="placeholder"):
        torch_xla.sync()
    assert X._get_tensors_handle([y])            # y was computed by that sync
    torch.testing.assert_close(y.cpu(), a * 2.0)
    z = y + 1.0
    torch_xla.sync()                             # b no longer blocks the barrier
    torch.testing.assert_close(z.cpu(), a * 2.0 + 1.0)
    with pytest.raises(RuntimeError, match="placeholder"):
        b.cpu()
