"""`torch.ops.xla.quantized_matmul`, `XlaQuantizedLinear` and `_XLAC._xla_dot_general`
against eager CPU: the dequantized weight times the activation in float, and the op's own
CPU kernel."""
import re

import pytest
import torch

import torch_xla
from torch_xla.experimental.xla_quantized_matmul import XlaQuantizedLinear


def _quantize(w: torch.Tensor, n_bits: int, block_size: int, symmetric: bool):
    """Round-to-nearest quantization of a float [N, K] weight in the op's layouts:
    (int weight, scale, zero point already times the scale or None, dequantized [N, K])."""
    n, k = w.shape
    rows = w if block_size == -1 else w.reshape(n * k // block_size, block_size)
    qmax, qmin = 2 ** (n_bits - 1) - 1, -2 ** (n_bits - 1)
    if symmetric:
        scale = rows.abs().amax(dim=1) / qmax
        zp = torch.zeros_like(scale)
    else:
        lo, hi = rows.amin(dim=1), rows.amax(dim=1)
        scale = (hi - lo) / (qmax - qmin)
        zp = torch.round(qmin - lo / scale)
    q = torch.clamp(torch.round(rows / scale[:, None]) + zp[:, None], qmin, qmax)
    deq = ((q - zp[:, None]) * scale[:, None]).reshape(n, k)
    zero_point = None if symmetric else zp * scale
    q = q.to(torch.int8)
    if block_size != -1:
        q = q.reshape(n, k // block_size, block_size).permute(1, 2, 0).contiguous()
        scale = scale.reshape(n, k // block_size).t().contiguous()
        if zero_point is not None:
            zero_point = zero_point.reshape(n, k // block_size).t().contiguous()
    return q, scale, zero_point, deq


CASES = [(bits, bs, sym, qa) for bits in (8, 4) for bs in (-1, 4) for sym in (True, False)
         for qa in (False, True) if not (bs != -1 and qa)]


# Each bit width, layout, symmetry and activation mode runs here at least once; the rest of
# the product in the slow target.
_FAST = {(8, -1, True, False), (8, -1, False, True), (4, -1, False, False), (4, 4, True, False),
         (8, 4, False, False), (4, -1, True, True)}


@pytest.mark.parametrize("n_bits,block_size,symmetric,quantize_activation",
                         [c if c in _FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_matches_cpu_and_dequantized_float(dev, n_bits, block_size, symmetric, quantize_activation):
    torch.manual_seed(0)
    w = torch.randn(16, 12)
    x = torch.randn(2, 3, 12)
    q, scale, zp, deq = _quantize(w, n_bits, block_size, symmetric)
    kw = dict(block_size=block_size, int4_weight=n_bits == 4, quantize_activation=quantize_activation)
    ref = torch.ops.xla.quantized_matmul(x, q, scale, zp, **kw)
    # The CPU kernel is the dequantized product (activation quantization adds its own error).
    tol = 0.05 if quantize_activation else 1e-4
    torch.testing.assert_close(ref, x @ deq.t(), rtol=tol, atol=tol)
    got = torch.ops.xla.quantized_matmul(x.to(dev), q.to(dev), scale.to(dev),
                                         None if zp is None else zp.to(dev), **kw)
    assert got.device.type == "xla" and got.dtype == ref.dtype
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_module_bf16_and_state_dict(dev):
    torch.manual_seed(1)
    q, scale, zp, _ = _quantize(torch.randn(8, 16), 8, 4, False)
    m = XlaQuantizedLinear(16, 8, is_symmetric=False, block_size=4)
    m.load_quantized_weight(q, scale, zp)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    ref = m.to(torch.bfloat16)(x)
    got = m.to(dev)(x.to(dev))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), ref, rtol=2e-2, atol=2e-2)
    fresh = XlaQuantizedLinear(16, 8, is_symmetric=False, block_size=4).to(torch.bfloat16)
    fresh.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    torch.testing.assert_close(fresh.to(dev)(x.to(dev)).cpu(), got.cpu())


def _dot_lines(t):
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([t])
    return [ln for ln in hlo.splitlines() if " dot(" in ln]


def test_hlo_dot_keeps_integer_operands(dev):
    x = torch.randn(3, 8, dtype=torch.bfloat16, device=dev)
    w = torch.randint(-128, 127, (4, 8), dtype=torch.int8, device=dev)
    s = torch.rand(4, dtype=torch.bfloat16, device=dev)
    (line,) = _dot_lines(torch.ops.xla.quantized_matmul(x, w, s, quantize_activation=True))
    assert re.search(r"= s32\[3,4\].* dot\(s8\[3,8\].*, s8\[4,8\]", line), line
    (line,) = _dot_lines(torch.ops.xla.quantized_matmul(x, w, s))
    assert re.search(r"= bf16\[3,4\].* dot\(bf16\[3,8\].*, s8\[4,8\]", line), line
    wb = torch.randint(-8, 7, (2, 4, 4), dtype=torch.int8, device=dev)
    sb = torch.rand(2, 4, dtype=torch.bfloat16, device=dev)
    (line,) = _dot_lines(torch.ops.xla.quantized_matmul(x, wb, sb, block_size=4, int4_weight=True))
    assert re.search(r"= bf16\[2,3,4\].* dot\(bf16\[3,2,4\].*, s(8|4)\[2,4,4\]", line), line
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([torch.ops.xla.quantized_matmul(x, w, s, int4_weight=True)])
    assert re.search(r"s4\[4,8\].* convert\(s8\[4,8\]", hlo)


def test_int4_weights_wrap_like_the_s4_type(dev):
    # An int8 container holding a value outside [-8, 7]: on the device the weight is s4.
    x = torch.ones(1, 2)
    w = torch.tensor([[9, -9]], dtype=torch.int8)
    s = torch.ones(1)
    got = torch.ops.xla.quantized_matmul(x.to(dev), w.to(dev), s.to(dev), int4_weight=True).cpu()
    torch.testing.assert_close(got, torch.tensor([[9.0 - 16 - 9 + 16]]))
    torch.testing.assert_close(torch.ops.xla.quantized_matmul(x, w, s, int4_weight=True), got)


@pytest.mark.parametrize("block_size,quantize_activation", [(-1, False), (-1, True), (4, False)])
def test_gradients_match_cpu(dev, block_size, quantize_activation):
    torch.manual_seed(2)
    q, scale, zp, _ = _quantize(torch.randn(6, 8), 8, block_size, False)
    x = torch.randn(3, 8)
    results = []
    for d in ("cpu", dev):
        leaves = [t.to(d).detach().requires_grad_() for t in (x, scale, zp)]
        out = torch.ops.xla.quantized_matmul(leaves[0], q.to(d), leaves[1], leaves[2], block_size=block_size,
                                             quantize_activation=quantize_activation)
        (out * torch.arange(6.0, device=d)).sum().backward()
        results.append([t.grad.cpu() for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantize_activation", [False, True])
def test_torch_compile_openxla(dev, quantize_activation):
    torch.manual_seed(3)
    q, scale, zp, _ = _quantize(torch.randn(8, 12), 8, -1, False)
    m = XlaQuantizedLinear(12, 8, quantize_activation=quantize_activation)
    m.load_quantized_weight(q, scale, zp)
    x = torch.randn(4, 12)
    ref = m(x)
    compiled = torch.compile(m.to(dev), backend="openxla")
    with torch.no_grad():
        got = compiled(x.to(dev))
    torch.testing.assert_close(got.cpu(), ref.detach(), rtol=1e-4, atol=1e-4)


def test_export_to_stablehlo_keeps_integer_dot():
    from torch_xla.stablehlo import exported_program_to_stablehlo
    q, scale, _, _ = _quantize(torch.randn(8, 12), 8, -1, True)
    m = XlaQuantizedLinear(12, 8, is_symmetric=True, quantize_activation=True)
    m.load_quantized_weight(q, scale)
    x = torch.randn(2, 12)
    ep = torch.export.export(m, (x,))
    text = exported_program_to_stablehlo(ep).get_stablehlo_text()
    assert re.search(r"stablehlo\.dot_general .*tensor<2x12xi8>, tensor<8x12xi8>\) -> tensor<2x8xi32>", text), text


@pytest.mark.parametrize("bad", ["weight_dtype", "blockwise_activation", "scale_shape"])
def test_bad_arguments_raise_as_on_cpu(dev, bad):
    x, w, s = torch.randn(2, 8), torch.randint(-8, 7, (4, 8), dtype=torch.int8), torch.rand(4)
    kw = {}
    if bad == "weight_dtype":
        w = w.float()
    elif bad == "blockwise_activation":
        w, s = torch.randint(-8, 7, (2, 4, 4), dtype=torch.int8), torch.rand(2, 4)
        kw = dict(block_size=4, quantize_activation=True)
    else:
        s = torch.rand(3)
    with pytest.raises(AssertionError) as cpu:
        torch.ops.xla.quantized_matmul(x, w, s, **kw)
    with pytest.raises(AssertionError) as xla:
        torch.ops.xla.quantized_matmul(x.to(dev), w.to(dev), s.to(dev), **kw)
    assert str(xla.value) == str(cpu.value)


def test_module_load_checks_layout():
    m = XlaQuantizedLinear(8, 4, block_size=4)
    with pytest.raises(AssertionError, match="Weight tensor is expected to be 3D"):
        m.load_quantized_weight(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4))
    with pytest.raises(AssertionError, match="Weight shape"):
        m.load_quantized_weight(torch.zeros(2, 4, 5, dtype=torch.int8), torch.zeros(2, 4))


def test_dot_general_integer_and_mixed(dev):
    a = torch.randint(-100, 100, (2, 3, 5), dtype=torch.int8)
    b = torch.randint(-100, 100, (2, 5, 4), dtype=torch.int8)
    out = torch_xla._XLAC._xla_dot_general(a.to(dev), b.to(dev), (([2], [1]), ([0], [0])),
                                           preferred_element_type=torch.int32)
    (line,) = _dot_lines(out)
    assert re.search(r"= s32\[2,3,4\].* dot\(s8\[2,3,5\].*, s8\[2,5,4\]", line), line
    torch.testing.assert_close(out.cpu(), torch.matmul(a.int(), b.int()))
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    out = torch_xla._XLAC._xla_dot_general(x.to(dev), b[0].to(dev), (([-1], [0]), ()))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), x @ b[0].to(torch.bfloat16), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dims,precision,match", [
    ((([1], [0]),), None, "tuple of 2 elements"),
    ((((1,), (0,)), ()), None, "must be a list"),
    ((([1], [0], [1]), ()), None, "both lhs and rhs or neither"),
    ((([1], [0]), ()), "HIGHEST", "precision_config is not supported"),
    ((([0], [0]), ()), None, "contracting dimension sizes"),
    ((([2], [0]), ()), None, "Value out of range"),
])
def test_dot_general_argument_errors(dev, dims, precision, match):
    x, w = torch.randn(3, 5, device=dev), torch.randn(5, 4, device=dev)
    with pytest.raises(RuntimeError, match=match):
        torch_xla._XLAC._xla_dot_general(x, w, dims, precision_config=precision)


def test_dot_general_refuses_cpu_tensors(dev):
    with pytest.raises(RuntimeError) as e:
        torch_xla._XLAC._xla_dot_general(torch.randn(3, 5).to(dev), torch.randn(5, 4, dtype=torch.float64),
                                         (([1], [0]), ()))
    assert str(e.value) == ("Expected input tensor (second argument) to be an actual XLA tensor. Got: CPUDoubleType. "
                            "Consider moving it (second argument) to XLA.")
