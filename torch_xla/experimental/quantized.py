"""`quantized_decomposed` ops (what PT2E quantization leaves in a model) on the xla device.

Each quantize / dequantize becomes one IR node (`_engine/lowering/qdq.py`): it computes
what PyTorch's decomposition computes on the CPU, and StableHLO export prints it as
`stablehlo.uniform_quantize` / `uniform_dequantize`. The scales and zero points are read
to the host when the op is traced: they are part of the quantized type.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

import torch.ao.quantization.fx._decomposed  # noqa: F401  (defines the quantized_decomposed ops)

from .._engine import pjrt
from .._engine.kernels import engine_op, library
from .._engine.lowering import qdq


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _host(v) -> List:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().reshape(-1).tolist()
    return [v]


def _check(dtype: torch.dtype, qmin: int, qmax: int) -> None:
    try:
        lo, hi = qdq.storage_range(_name(dtype))
    except KeyError:
        raise ValueError(f"Unsupported dtype: {dtype}") from None
    if qmin < lo or qmax > hi:
        raise AssertionError(f"quant_min out of bound for dtype, quant_min_lower_bound: {lo} quant_min: {qmin}"
                             if qmin < lo else
                             f"quant_max out of bound for dtype, quant_max_upper_bound: {hi} quant_max: {qmax}")


def _float_input(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    if x.dtype != torch.float32:
        raise AssertionError(f"Expecting input to have dtype torch.float32, but got dtype: {x.dtype}")
    return x


def _axis(x: torch.Tensor, axis: int) -> int:
    if axis >= x.dim():
        raise AssertionError(f"Expecting axis to be < {x.dim()}")
    return axis % x.dim()


def _quantize(x, scales, zps, qmin, qmax, dtype, axis, scale_dtype: Optional[torch.dtype]):
    x = _float_input(x)
    _check(dtype, qmin, qmax)
    if axis < 0:
        # PyTorch: x * (1.0 / scale), the Python double reciprocal used in float32
        inv, compute = [float(np.float32(1.0 / scales[0]))], "float32"
    else:
        sd = pjrt.device_dtype(scale_dtype)
        inv = (np.asarray(1.0, sd) / np.asarray(scales, sd)).tolist()
        compute = np.result_type(np.float32, sd).name
    if len(scales) == 1 and axis >= 0 and x.shape[axis] != 1:
        qaxis, qscales, qzps = -1, scales, zps
    else:
        qaxis, qscales, qzps = axis, scales, zps
    qtype = qdq.quantized_type(_name(dtype), qmin, qmax, qscales, qzps, qaxis)
    (out,) = engine_op("xla::quantize_tensor", [x],
                       (tuple(inv), tuple(int(z) for z in zps), int(qmin), int(qmax), _name(dtype), axis, compute,
                        qtype), [(tuple(x.shape), dtype)])
    return out


def _dequantize(x, scales, zps, qmin, qmax, dtype, axis, out_dtype, scale_dtype, zp_dtype):
    if x.dtype != dtype:
        raise AssertionError(f"Expecting input to have dtype: {dtype}, but got {x.dtype}")
    _check(dtype, qmin, qmax)
    out_dtype = out_dtype or torch.float32
    zq = zps if zps is not None else [0] * len(scales)
    qaxis = -1 if axis < 0 or (len(scales) == 1 and x.shape[axis] != 1) else axis
    qtype = qdq.quantized_type(_name(dtype), qmin, qmax, scales, zq, qaxis)
    sd = None if scale_dtype is None else pjrt.device_dtype(scale_dtype).name
    zd = None if zp_dtype is None else pjrt.device_dtype(zp_dtype).name
    (out,) = engine_op("xla::dequantize_tensor", [x],
                       (tuple(float(s) for s in scales), tuple(int(z) for z in zq), axis, sd, zd,
                        _name(out_dtype), qtype), [(tuple(x.shape), out_dtype)])
    return out


def _one(t: torch.Tensor, what: str) -> None:
    if t.numel() != 1:
        raise AssertionError(f"Expecting {what} tensor to be one element, but received : {t.numel()}")


def quantize_per_tensor(input, scale, zero_point, quant_min, quant_max, dtype):
    return _quantize(input, [float(scale)], [int(zero_point)], quant_min, quant_max, dtype, -1, None)


def quantize_per_tensor_tensor(input, scale, zero_point, quant_min, quant_max, dtype):
    _one(zero_point, "zero_point")
    _one(scale, "scale")
    return quantize_per_tensor(input, _host(scale)[0], _host(zero_point)[0], quant_min, quant_max, dtype)


def dequantize_per_tensor(input, scale, zero_point, quant_min, quant_max, dtype, *, out_dtype=None):
    return _dequantize(input, [float(scale)], [int(zero_point)], quant_min, quant_max, dtype, -1, out_dtype,
                       None, None)


def dequantize_per_tensor_tensor(input, scale, zero_point, quant_min, quant_max, dtype, *, out_dtype=None):
    _one(zero_point, "zero_point")
    _one(scale, "scale")
    return dequantize_per_tensor(input, _host(scale)[0], _host(zero_point)[0], quant_min, quant_max, dtype,
                                 out_dtype=out_dtype)


def quantize_per_channel(input, scales, zero_points, axis, quant_min, quant_max, dtype):
    axis = _axis(input, axis)
    return _quantize(input, _host(scales), _host(zero_points), quant_min, quant_max, dtype, axis, scales.dtype)


def dequantize_per_channel(input, scales, zero_points, axis, quant_min, quant_max, dtype, *, out_dtype=None):
    axis = _axis(input, axis)
    zps = None if zero_points is None else _host(zero_points)
    return _dequantize(input, _host(scales), zps, quant_min, quant_max, dtype, axis, out_dtype, scales.dtype,
                       None if zero_points is None else zero_points.dtype)


for _op, _fn in (("quantize_per_tensor", quantize_per_tensor),
                 ("quantize_per_tensor.tensor", quantize_per_tensor_tensor),
                 ("dequantize_per_tensor", dequantize_per_tensor),
                 ("dequantize_per_tensor.tensor", dequantize_per_tensor_tensor),
                 ("quantize_per_channel", quantize_per_channel),
                 ("dequantize_per_channel", dequantize_per_channel)):
    library.impl_foreign("quantized_decomposed", _op, _fn, "PrivateUse1")
