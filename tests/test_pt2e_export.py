"""PT2E quantize / dequantize ops (`quantized_decomposed::*`): on the device exactly as the
CPU computes them, and exported as StableHLO's uniform quantize ops on quantized types."""
from __future__ import annotations

import re

import pytest
import torch

import torch_xla.core.xla_model as xm
from torch_xla._engine.lowering import qdq
from torch_xla.stablehlo import exported_program_to_stablehlo
from helpers import XLA

qd = torch.ops.quantized_decomposed


def _ties(shape, scale, seed=0):
    """Values that hit rounding ties (k + 0.5) * scale, out-of-range values and noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 40 * scale
    flat = x.view(-1)
    n = flat.numel() // 3
    flat[:n] = (torch.randint(-300, 300, (n,), generator=g) + 0.5) * scale
    return x


@pytest.mark.parametrize("dtype,qmin,qmax", [(torch.int8, -128, 127), (torch.uint8, 0, 255),
                                             (torch.int8, -127, 127)])
def test_per_tensor_matches_cpu_exactly(dtype, qmin, qmax):
    x = _ties((4, 5, 6), 0.37)
    zp = 3 if dtype == torch.uint8 else -2
    q_cpu = qd.quantize_per_tensor(x, 0.37, zp, qmin, qmax, dtype)
    d_cpu = qd.dequantize_per_tensor(q_cpu, 0.37, zp, qmin, qmax, dtype)
    q = qd.quantize_per_tensor(x.to(XLA), 0.37, zp, qmin, qmax, dtype)
    d = qd.dequantize_per_tensor(q, 0.37, zp, qmin, qmax, dtype)
    assert q.dtype == dtype and d.dtype == torch.float32
    assert torch.equal(q.cpu(), q_cpu)
    assert torch.equal(d.cpu(), d_cpu)


def test_per_tensor_tensor_variants_and_half_inputs_match_cpu():
    x = _ties((3, 7), 0.05, seed=1)
    scale, zp = torch.tensor([0.05], dtype=torch.float64), torch.tensor([4])
    for inp in (x, x.to(torch.bfloat16), x.to(torch.float16)):
        q_cpu = qd.quantize_per_tensor.tensor(inp, scale, zp, -128, 127, torch.int8)
        q = qd.quantize_per_tensor.tensor(inp.to(XLA), scale.to(XLA), zp.to(XLA), -128, 127, torch.int8)
        assert torch.equal(q.cpu(), q_cpu)
    for out_dtype in (None, torch.bfloat16, torch.float64):
        d_cpu = qd.dequantize_per_tensor.tensor(q_cpu, scale, zp, -128, 127, torch.int8, out_dtype=out_dtype)
        d = qd.dequantize_per_tensor.tensor(q_cpu.to(XLA), scale.to(XLA), zp.to(XLA), -128, 127, torch.int8,
                                            out_dtype=out_dtype)
        assert d.dtype == d_cpu.dtype
        assert torch.equal(d.cpu(), d_cpu)


@pytest.mark.parametrize("axis,scale_dtype", [(0, torch.float32), (2, torch.float32), (-1, torch.float32),
                                              (1, torch.float64)])
def test_per_channel_matches_cpu_exactly(axis, scale_dtype):
    x = _ties((3, 4, 5), 0.11, seed=2)
    n = x.shape[axis]
    scales = (torch.rand(n, generator=torch.Generator().manual_seed(3)) * 0.2 + 0.01).to(scale_dtype)
    zps = torch.arange(n) - 1
    q_cpu = qd.quantize_per_channel(x, scales, zps, axis, -127, 127, torch.int8)
    d_cpu = qd.dequantize_per_channel(q_cpu, scales, zps, axis, -127, 127, torch.int8)
    d0_cpu = qd.dequantize_per_channel(q_cpu, scales, None, axis, -127, 127, torch.int8)
    q = qd.quantize_per_channel(x.to(XLA), scales.to(XLA), zps.to(XLA), axis, -127, 127, torch.int8)
    d = qd.dequantize_per_channel(q, scales.to(XLA), zps.to(XLA), axis, -127, 127, torch.int8)
    d0 = qd.dequantize_per_channel(q, scales.to(XLA), None, axis, -127, 127, torch.int8)
    assert torch.equal(q.cpu(), q_cpu)
    assert torch.equal(d.cpu(), d_cpu)
    assert torch.equal(d0.cpu(), d0_cpu)


def test_bad_arguments_raise_as_on_cpu():
    x = torch.randn(2, 3)
    for dev in ("cpu", XLA):
        with pytest.raises(AssertionError, match="Expecting input to have dtype"):
            qd.quantize_per_tensor(x.to(torch.int32).to(dev), 0.1, 0, -128, 127, torch.int8)
        with pytest.raises(AssertionError, match="Expecting input to have dtype"):
            qd.dequantize_per_tensor(x.to(dev), 0.1, 0, -128, 127, torch.int8)
        with pytest.raises(AssertionError, match="out of bound"):
            qd.quantize_per_tensor(x.to(dev), 0.1, 0, -129, 127, torch.int8)


class QdqModel(torch.nn.Module):
    """A hand-made PT2E graph: per-tensor qdq of the activations, per-channel qdq of the weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 4)
        self.register_buffer("w_scale", torch.tensor([0.01, 0.02, 0.03, 0.04]))
        self.register_buffer("w_zp", torch.zeros(4, dtype=torch.int64))

    def forward(self, x):
        x = qd.dequantize_per_tensor(qd.quantize_per_tensor(x, 0.25, 3, -128, 127, torch.int8),
                                     0.25, 3, -128, 127, torch.int8)
        w = qd.dequantize_per_channel(qd.quantize_per_channel(self.fc.weight, self.w_scale, self.w_zp, 0, -127,
                                                              127, torch.int8),
                                      self.w_scale, self.w_zp, 0, -127, 127, torch.int8)
        y = torch.nn.functional.linear(x, w, self.fc.bias)
        return qd.quantize_per_tensor(y, 0.125, 0, -128, 127, torch.int8)


def test_export_has_uniform_ops_with_scales_and_runs_like_cpu():
    m = QdqModel().eval()
    x = torch.randn(2, 6) * 3
    shlo = exported_program_to_stablehlo(torch.export.export(m, (x,)))
    text = shlo.get_stablehlo_text()
    assert text.count("stablehlo.uniform_quantize") == 3
    assert text.count("stablehlo.uniform_dequantize") == 2
    assert "tensor<2x6x!quant.uniform<i8:f32, 2.500000e-01:3>>" in text
    assert ("tensor<4x6x!quant.uniform<i8<-127:127>:f32:0, "
            "{1.000000e-02,2.000000e-02,3.000000e-02,4.000000e-02}>>") in text
    # the result is int8 storage: its quantized value is bit-cast once
    assert "!quant.uniform<i8:f32, 1.250000e-01>>) -> tensor<2x4xi8>" in text
    assert "torch_xla.uniform" not in text   # composites and their decompositions are gone
    with torch.no_grad():
        ref = m(x)
    out = shlo(x)
    assert out.dtype == torch.int8
    # the float linear between the quantized ends may round its last bit differently
    assert (out.cpu().int() - ref.int()).abs().max() <= 1


def test_exported_qdq_only_model_is_exact():
    class M(torch.nn.Module):
        def forward(self, x):
            q = qd.quantize_per_tensor(x, 0.1, -5, -128, 127, torch.int8)
            return qd.dequantize_per_tensor(q, 0.1, -5, -128, 127, torch.int8) * 2

    x = _ties((3, 8), 0.1, seed=4)
    shlo = exported_program_to_stablehlo(torch.export.export(M(), (x,)))
    assert torch.equal(shlo(x).cpu(), M()(x))
    assert shlo.get_stablehlo_text().count("!quant.uniform<i8:f32, 1.000000e-01:-5>") == 2


def test_rewrite_text_pairs_and_bitcasts():
    x = torch.randn(2, 3).to(XLA)
    q = qd.quantize_per_tensor(x, 0.5, 1, -128, 127, torch.int8)
    d_alone = qd.dequantize_per_tensor(torch.ones(2, 3, dtype=torch.int8).to(XLA), 0.5, 1, -128, 127, torch.int8)
    raw = xm.get_stablehlo([q, d_alone])
    text = qdq.rewrite_text(raw)
    assert qdq.rewrite_text(text) == text
    assert text.count("stablehlo.uniform_quantize") == 1
    # a quantize whose storage value is a result, a dequantize of plain int8: a bit cast each
    assert len(re.findall(r"stablehlo\.bitcast_convert", text)) == 2
    assert "decomposition" not in text
    assert qdq.rewrite_text("module {}") == "module {}"


def test_torchao_pt2e_flow_exports_and_runs():
    quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e",
                                        reason="PT2E prepare/convert moved from torch to torchao (not installed)")
    xnn = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer", reason="torchao's XNNPACKQuantizer")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 5)).eval()
    args = (torch.randn(1, 3, 8, 8),)
    for per_channel in (False, True):
        g = torch.export.export(m, args).module()
        g = quantize_pt2e.prepare_pt2e(g, xnn.XNNPACKQuantizer().set_global(
            xnn.get_symmetric_quantization_config(is_per_channel=per_channel)))
        g(*args)
        g = quantize_pt2e.convert_pt2e(g, fold_quantize=False)
        shlo = exported_program_to_stablehlo(torch.export.export(g, args))
        text = shlo.get_stablehlo_text()
        assert text.count("stablehlo.uniform_quantize") >= 4
        assert (":f32:0, {" in text) == per_channel
        torch.testing.assert_close(shlo(*args).cpu(), g(*args), rtol=1e-4, atol=1e-4)
