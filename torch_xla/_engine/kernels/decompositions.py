"""Aten ops served on the device by PyTorch's own decompositions (`torch._decomp`).

An op listed here has no lowering of its own: its decomposition runs on the inner
tensors, below functionalization, and every op it calls becomes IR nodes through the
lowering table. That keeps these ops on the device (no CPU round trip) and avoids the
generic C++ kernels of some of them, which fill a fresh tensor through views: inner
tensors do not share storage, so such writes would be lost. Each call counts as
`decomposed::<op>`. An overload that also has a lowering keeps the lowering.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from .. import telemetry

# aten overloads (packet.overload) whose decompositions use only lowered ops.
DECOMPOSED = (
    "_chunk_cat.default",
    "_batch_norm_with_update.default",
    "_upsample_bilinear2d_aa.vec",
    "multi_margin_loss.default",
    "multilabel_margin_loss_forward.default",
    "max_unpool2d.default",
    "max_unpool3d.default",
    "grid_sampler_2d.default",
    "channel_shuffle.default",
    "isin.Tensor_Tensor",
    "isin.Tensor_Scalar",
    "isin.Scalar_Tensor",
    "logspace.default",
    "logspace.Tensor_Tensor",
    "logspace.Tensor_Scalar",
    "logspace.Scalar_Tensor",
    "linspace.Tensor_Tensor",
    "linspace.Tensor_Scalar",
    "linspace.Scalar_Tensor",
    "_addmm_activation.default",
    "addmm.dtype",
    "baddbmm.dtype",
    "_batch_norm_no_update.default",
    "_batch_norm_with_update_functional.default",
    "_unsafe_masked_index.default",
    "_unsafe_masked_index_put_accumulate.default",
    "_weight_norm_interface.default",
    "affine_grid_generator.default",
    "celu.default",
    "dist.default",
    "hann_window.default",
    "hann_window.periodic",
    "hardsigmoid_backward.default",
    "hardswish_backward.default",
    "logit_backward.default",
    "rrelu_with_noise_backward.default",
    "rot90.default",
    "tril_indices.default",
    "triu_indices.default",
    "unsafe_split.Tensor",
    "unsafe_split_with_sizes.default",
)


class DecompKernel:
    """Runs a torch decomposition on inner XLA tensors."""

    __slots__ = ("fn", "counter")

    def __init__(self, fn: Callable, name: str):
        self.fn = fn
        self.counter = "decomposed::" + name.split(".")[0]

    def __call__(self, *args, **kwargs):
        telemetry.inc(self.counter)
        return self.fn(*args, **kwargs)


def kernels(lowered) -> Dict[str, DecompKernel]:
    """{registration name: kernel} for every listed overload that has no lowering."""
    from torch._decomp import decomposition_table
    out = {}
    for name in DECOMPOSED:
        if name in lowered:
            continue
        packet, ov = name.split(".", 1)
        op = getattr(getattr(torch.ops.aten, packet), ov)
        fn = decomposition_table.get(op)
        if fn is None:
            raise RuntimeError(f"torch._decomp has no decomposition of aten::{name}")
        out[packet if ov == "default" else name] = DecompKernel(fn, name)
    return out
