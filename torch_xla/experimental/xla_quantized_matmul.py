"""Weight-only quantized matrix products: `torch.ops.xla.quantized_matmul` and
`XlaQuantizedLinear`.

Weights are int8 (int4 values in an int8 container with `int4_weight=True`), quantized
per output channel (`w` [N, K], scale [N]) or blockwise along the input (`w` [K / B, B, N],
scale [K / B, N]); asymmetric quantization adds a zero point (already multiplied by the
scale) of the scale's shape, subtracted as `sum(x) * zero_point`. With
`quantize_activation` the activation is quantized to int8 per row as well and the product
is an int8 x int8 -> int32 dot.

On the xla device the op is one graph node whose dot keeps the integer weight as its
operand (`bf16 x s8 -> bf16`, `s8 x s8 -> s32`, `s4` weights where the backend has int4
dots); everywhere else (CPU tensors, meta and fake tensors) it is the reference
computation below, which dequantizes.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
# PyTorch's `quantized_decomposed` ops (quantize_per_channel ...), with which weights for
# this module are quantized, exist only once this module of PyTorch is imported.
import torch.ao.quantization.fx._decomposed  # noqa: F401
import torch.nn.functional as F

from .._engine.kernels import engine_op, library

__all__ = ["XlaQuantizedLinear", "quantized_matmul"]

SCHEMA = ("quantized_matmul(Tensor x, Tensor w, Tensor scale, Tensor? zero_point=None, int? block_size=-1, "
          "bool? int4_weight=False, bool? quantize_activation=False) -> Tensor")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _check_per_channel(input_dim: int, output_dim: int, w: torch.Tensor, scale: torch.Tensor,
                       zero_point: Optional[torch.Tensor]) -> None:
    _check(w.dtype == torch.int8, f"Weight dtype is expected to be torch.int8, got {w.dtype}.")
    _check(w.dim() == 2, f"Weight tensor is expected to be 2D, got {w.dim()}D Tensor.")
    _check(list(w.shape) == [output_dim, input_dim],
           f"Weight shape is expected to be [output_dim, input_dim], output_dim: {output_dim}, "
           f"input_dim: {input_dim}, but got {list(w.shape)}.")
    _check(scale.dim() == 1 and scale.shape[0] == w.shape[0],
           f"weight scaler shape is expect to be [out_channel,], got {scale.shape}, weight shape {list(w.shape)}.")
    if zero_point is not None:
        _check(zero_point.dim() == 1 and zero_point.shape[0] == w.shape[0],
               f"zero point shape is expect to be [out_channel,], got {zero_point.shape}, "
               f"weight shape {list(w.shape)}.")


def _check_blockwise(input_dim: int, output_dim: int, block_size: int, w: torch.Tensor, scale: torch.Tensor,
                     zero_point: Optional[torch.Tensor]) -> None:
    _check(w.dtype == torch.int8, f"Weight dtype is expected to be torch.int8, got {w.dtype}.")
    _check(w.dim() == 3, f"Weight tensor is expected to be 3D, got {w.dim()}D Tensor.")
    _check(block_size > 0 and input_dim % block_size == 0,
           f"input_dim should be divisible by block_size, got input_dim: {input_dim}, block_size: {block_size}.")
    _check(list(w.shape) == [input_dim // block_size, block_size, output_dim],
           f"Weight shape is expected to be [input_dim / block_size, block_size, output_dim], input_dim: "
           f"{input_dim}, block_size: {block_size}, output_dim: {output_dim}, but got {list(w.shape)}.")
    for name, t in (("weight scaler", scale), ("zero_point", zero_point)):
        if t is None:
            continue
        _check(t.dim() == 2, f"{name} is expected to be 2D, got {t.dim()}D Tensor.")
        _check(t.shape[0] == w.shape[0] and t.shape[1] == w.shape[-1],
               f"{name} shape is expect to be [in_channel / block_size, out_channel], got {t.shape}, "
               f"weight shape {list(w.shape)}.")


def _check_args(x, w, scale, zero_point, block_size, quantize_activation) -> None:
    if block_size == -1:
        _check_per_channel(x.shape[-1], scale.shape[0], w, scale, zero_point)
    else:
        _check(not quantize_activation, "Blockwise quantization does not support activation quantization.")
        _check_blockwise(x.shape[-1], w.shape[-1], block_size, w, scale, zero_point)


def _quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization along the last dimension: (int8 values, scale [..., 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / scale).to(torch.int8), scale.to(x.dtype)


def _reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor] = None,
               block_size: Optional[int] = -1, int4_weight: Optional[bool] = False,
               quantize_activation: Optional[bool] = False) -> torch.Tensor:
    """The op on any device but xla: the integer weight converted to the activation's
    dtype (int32 for quantized activations), then an ordinary product. int4 weights keep
    their low 4 bits, sign-extended, as the device's s4 conversion does."""
    block_size = -1 if block_size is None else block_size
    _check_args(x, w, scale, zero_point, block_size, quantize_activation)
    if int4_weight:
        w = ((w.to(torch.int32) << 28) >> 28).to(torch.int8)
    if block_size == -1:
        if quantize_activation:
            x, x_scale = _quantize_rows(x)
            # int32 operands: an int8 product would overflow.
            x = x.to(torch.int32)
            out = F.linear(x, w.to(torch.int32))
        else:
            out = F.linear(x, w.to(x.dtype))
        out = out * scale
        if zero_point is not None:
            out = out - torch.einsum("...c,z->...z", x, zero_point)
        if quantize_activation:
            out = out * x_scale
        return out
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    out = torch.einsum("scn,...sc->...sn", w.to(x.dtype), xb)
    out = torch.einsum("sn,...sn->...n", scale, out)
    if zero_point is not None:
        out = out - torch.matmul(xb.sum(dim=-1), zero_point)
    return out


# (shape, dtype) of the op's result per argument signature, found once by running the
# reference on meta tensors (which also raises PyTorch's errors for bad dtypes).
_avals: Dict[tuple, Tuple[tuple, torch.dtype]] = {}


def _out_aval(x, w, scale, zero_point, block_size, quantize_activation) -> Tuple[tuple, torch.dtype]:
    ts = (x, w, scale) + (() if zero_point is None else (zero_point,))
    key = tuple((tuple(t.shape), t.dtype) for t in ts) + (zero_point is None, block_size, quantize_activation)
    aval = _avals.get(key)
    if aval is None:
        metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ts]
        if zero_point is None:
            metas.append(None)
        out = _reference(*metas, block_size=block_size, quantize_activation=quantize_activation)
        aval = _avals[key] = (tuple(out.shape), out.dtype)
    return aval


def _quantized_matmul_xla(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                          zero_point: Optional[torch.Tensor] = None, block_size: Optional[int] = -1,
                          int4_weight: Optional[bool] = False,
                          quantize_activation: Optional[bool] = False) -> torch.Tensor:
    block_size = -1 if block_size is None else int(block_size)
    int4_weight, quantize_activation = bool(int4_weight), bool(quantize_activation)
    _check_args(x, w, scale, zero_point, block_size, quantize_activation)
    inputs = [x, w, scale] + ([] if zero_point is None else [zero_point])
    devices = {t.device for t in inputs}
    if len(devices) > 1:
        a, b = sorted(str(d) for d in devices)[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{b} and {a}!")
    shape, dtype = _out_aval(x, w, scale, zero_point, block_size, quantize_activation)
    (out,) = engine_op("xla::quantized_matmul", inputs,
                       (block_size, int4_weight, quantize_activation, zero_point is not None), [(shape, dtype)])
    return out


class _QuantizedMatmul(torch.autograd.Function):
    """Gradients of the activation, scale and zero point: those of the reference
    computation (the weight is integer), so every device gets the CPU's. The forward is the
    device's kernel."""

    @staticmethod
    def forward(ctx, x, w, scale, zero_point, block_size, int4_weight, quantize_activation):
        ctx.save_for_backward(x, w, scale, zero_point)
        ctx.options = (block_size, int4_weight, quantize_activation)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.xla.quantized_matmul(x, w, scale, zero_point, block_size, int4_weight,
                                                  quantize_activation)

    @staticmethod
    def backward(ctx, grad):
        x, w, scale, zero_point = ctx.saved_tensors
        wanted = [i for i in (0, 2, 3) if ctx.needs_input_grad[i]]
        args = [x, w, scale, zero_point]
        with torch.enable_grad():
            for i in wanted:
                args[i] = args[i].detach().requires_grad_()
            out = _reference(*args, *ctx.options)
            found = torch.autograd.grad(out, [args[i] for i in wanted], grad, allow_unused=True)
        grads = [None] * 7
        for i, g in zip(wanted, found):
            grads[i] = g
        return tuple(grads)


def _autograd_kernel(x, w, scale, zero_point=None, block_size=-1, int4_weight=False, quantize_activation=False):
    return _QuantizedMatmul.apply(x, w, scale, zero_point, block_size, int4_weight, quantize_activation)


library.define("xla", SCHEMA)
library.impl_ns("xla", "quantized_matmul", _quantized_matmul_xla, "PrivateUse1")
library.impl_ns("xla", "quantized_matmul", _reference, "CompositeExplicitAutograd")
library.impl_ns("xla", "quantized_matmul", _reference, "Meta")
library.impl_ns("xla", "quantized_matmul", _autograd_kernel, "Autograd")

quantized_matmul = torch.ops.xla.quantized_matmul


class XlaQuantizedLinear(torch.nn.Module):
    """A linear layer (no bias) with int8 / int4 weights: `torch.ops.xla.quantized_matmul`
    of its input with the buffers `weight`, `weight_scaler` and `zero_point` (None when
    symmetric). Load them with `load_quantized_weight`; the buffers start as zeros of the
    layout's shapes, so `load_state_dict` of a loaded layer's state also works."""

    def __init__(self, input_dim: int, output_dim: int, is_symmetric: bool = False, block_size: int = -1,
                 int4_weight: bool = False, quantize_activation: bool = False) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.is_symmetric = is_symmetric
        self.block_size = block_size
        self.int4_weight = int4_weight
        self.quantize_activation = quantize_activation
        if block_size == -1:
            w_shape, s_shape = (output_dim, input_dim), (output_dim,)
        else:
            _check(block_size > 0 and input_dim % block_size == 0,
                   f"input_dim should be divisible by block_size, got input_dim: {input_dim}, "
                   f"block_size: {block_size}.")
            w_shape = (input_dim // block_size, block_size, output_dim)
            s_shape = (input_dim // block_size, output_dim)
        self.register_buffer("weight", torch.zeros(w_shape, dtype=torch.int8))
        self.register_buffer("weight_scaler", torch.zeros(s_shape))
        if is_symmetric:
            self.zero_point = None
        else:
            self.register_buffer("zero_point", torch.zeros(s_shape))

    def load_quantized_weight(self, weight: torch.Tensor, weight_scaler: torch.Tensor,
                              zero_point: Optional[torch.Tensor] = None) -> None:
        """Sets the quantized weight, checked against the layer's layout.

        weight: int8, [output_dim, input_dim] per channel, [input_dim / block_size,
          block_size, output_dim] blockwise.
        weight_scaler, zero_point: [output_dim] per channel, [input_dim / block_size,
          output_dim] blockwise; the zero point is subtracted as `sum(x) * zero_point`.
        """
        if self.block_size == -1:
            _check_per_channel(self.input_dim, self.output_dim, weight, weight_scaler, zero_point)
        else:
            _check_blockwise(self.input_dim, self.output_dim, self.block_size, weight, weight_scaler, zero_point)
        self.weight = weight
        self.weight_scaler = weight_scaler
        if zero_point is not None and "zero_point" not in self._buffers:
            # A symmetric layer given a zero point: kept as a buffer, so `.to()` moves it.
            del self.zero_point
            self.register_buffer("zero_point", zero_point)
        else:
            self.zero_point = zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.xla.quantized_matmul(x, self.weight, self.weight_scaler, self.zero_point,
                                              block_size=self.block_size, int4_weight=self.int4_weight,
                                              quantize_activation=self.quantize_activation)

    def extra_repr(self) -> str:
        return (f"input_dim={self.input_dim}, output_dim={self.output_dim}, is_symmetric={self.is_symmetric}, "
                f"block_size={self.block_size}, int4_weight={self.int4_weight}, "
                f"quantize_activation={self.quantize_activation}")
