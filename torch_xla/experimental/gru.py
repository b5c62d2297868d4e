"""`torch.nn.GRU` whose time loop is one loop of the compiled program on xla tensors.

PyTorch's GRU on the xla device traces one set of ops per time step and layer, so a long
sequence makes a huge graph. This subclass runs each layer as a single `lax.scan`
(`_engine/lowering/rnn.py`) with a hand-written backward. `import torch_xla` installs it
as `torch.nn.GRU` (patch registry entry `nn_gru`, `PT_XLA_PATCH_GRU=0` turns it off);
the original class stays available as `torch.nn.GRU._orig`.

Bidirectional GRUs are the original class; packed sequences and tensors on other devices
run the original forward.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence

from .._engine import patches
from .._engine.kernels import engine_op

_ORIG_GRU = nn.GRU


class _GRULayer(torch.autograd.Function):
    """One GRU layer over a (T, B, I) sequence: (outputs (T, B, H), last hidden (B, H))."""

    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh):
        has_bias = b_ih is not None
        inputs = [x, h0, w_ih, w_hh] + ([b_ih, b_hh] if has_bias else [])
        ctx.has_bias = has_bias
        ctx.save_for_backward(*inputs)
        T, B = x.shape[0], x.shape[1]
        H = h0.shape[-1]
        out, h = engine_op("xla::gru_layer", inputs, (has_bias,), [((T, B, H), x.dtype), ((B, H), x.dtype)])
        return out, h

    @staticmethod
    def backward(ctx, g_out, g_h):
        inputs = list(ctx.saved_tensors)
        x = inputs[0]
        if g_out is None:
            g_out = torch.zeros(x.shape[0], x.shape[1], inputs[1].shape[-1], dtype=x.dtype, device=x.device)
        if g_h is None:
            g_h = torch.zeros_like(inputs[1])
        grads = engine_op("xla::gru_layer_backward", inputs + [g_out, g_h], (ctx.has_bias,),
                          [(tuple(t.shape), t.dtype) for t in inputs])
        return tuple(grads) + ((None, None) if not ctx.has_bias else ())


class GRU(_ORIG_GRU):
    __doc__ = (_ORIG_GRU.__doc__ or "") + "\n    On xla tensors each layer's time loop is one program loop.\n"
    _orig = _ORIG_GRU

    def __new__(cls, *args, **kwargs):
        bidirectional = kwargs.get('bidirectional', args[5] if len(args) > 5 else False)
        if bidirectional:
            logging.warning("torch_xla GRU: bidirectional GRUs use torch.nn.GRU's own implementation")
            return _ORIG_GRU(*args, **kwargs)
        return super().__new__(cls)

    def forward(self, input, hx=None):
        if (isinstance(input, PackedSequence) or input.device.type != 'xla' or self.bidirectional
                or getattr(self, 'proj_size', 0)):
            return super().forward(input, hx)
        batched = input.dim() == 3
        if not batched:
            input = input.unsqueeze(1)
            if hx is not None:
                hx = hx.unsqueeze(1)
        if self.batch_first:
            input = input.transpose(0, 1)
        if hx is None:
            hx = torch.zeros(self.num_layers, input.shape[1], self.hidden_size, dtype=input.dtype,
                             device=input.device)
        elif hx.shape != (self.num_layers, input.shape[1], self.hidden_size):
            raise RuntimeError(f"Expected hidden size {(self.num_layers, input.shape[1], self.hidden_size)}, "
                               f"got {list(hx.shape)}")
        layer_in = input
        last = []
        for layer in range(self.num_layers):
            b_ih: Optional[torch.Tensor] = getattr(self, f'bias_ih_l{layer}') if self.bias else None
            b_hh: Optional[torch.Tensor] = getattr(self, f'bias_hh_l{layer}') if self.bias else None
            out, h = _GRULayer.apply(layer_in, hx[layer], getattr(self, f'weight_ih_l{layer}'),
                                     getattr(self, f'weight_hh_l{layer}'), b_ih, b_hh)
            last.append(h)
            if self.dropout and self.training and layer < self.num_layers - 1:
                out = F.dropout(out, self.dropout, training=True)
            layer_in = out
        output, h_n = layer_in, torch.stack(last)
        if self.batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output, h_n = output.squeeze(1), h_n.squeeze(1)
        return output, h_n


def install() -> bool:
    """Patch `nn_gru`: makes `torch.nn.GRU` this class (the original stays as `torch.nn.GRU._orig`)."""
    if not patches.signature_matches(_ORIG_GRU.forward, ["self", "input", "hx"], "torch.nn.GRU"):
        return False
    nn.GRU = GRU
    nn.modules.rnn.GRU = GRU
    return True
