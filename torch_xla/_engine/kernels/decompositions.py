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


def _masked_select(x, mask):
    """The selected elements gathered on the device at the positions of the mask's
    nonzero elements (one host read of their count, as `nonzero`)."""
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    x, mask = torch.broadcast_tensors(x, mask)
    pos = torch.ops.aten.nonzero(mask.reshape(-1)).reshape(-1)
    return torch.ops.aten.index_select(x.reshape(-1), 0, pos)


def _runs(values, sorted_flat):
    """(first position of each run of equal elements, run number of each element) of a
    1-D tensor; NaNs are all distinct, as on the CPU."""
    n = sorted_flat.shape[0]
    head = torch.ones((1,), dtype=torch.bool, device=sorted_flat.device)
    new = torch.cat([head, sorted_flat[1:] != sorted_flat[:-1]]) if n > 1 else head[:n]
    starts = torch.ops.aten.nonzero(new).reshape(-1)
    return starts, torch.cumsum(new.long(), 0) - 1


def _counts(starts, n):
    end = torch.full((1,), n, dtype=torch.int64, device=starts.device)
    return torch.cat([starts[1:], end]) - starts


def _unique2(x, sorted=True, return_inverse=False, return_counts=False):
    """torch.unique without dim: a stable sort on the device, the runs of equal values
    found with one `nonzero` host read. The CPU sorts whatever `sorted` says."""
    empty = torch.zeros((0,), dtype=torch.int64, device=x.device)
    flat = x.reshape(-1)
    n = flat.shape[0]
    if n == 0:
        return flat, (torch.zeros(x.shape, dtype=torch.int64, device=x.device) if return_inverse else empty), empty
    vals, perm = torch.sort(flat, stable=True)
    starts, run = _runs(vals, vals)
    out = torch.ops.aten.index_select(vals, 0, starts)
    inverse = empty
    if return_inverse:
        inverse = torch.zeros((n,), dtype=torch.int64, device=x.device).scatter(0, perm, run).reshape(x.shape)
    return out, inverse, _counts(starts, n) if return_counts else empty


def _unique(x, sorted=True, return_inverse=False):
    out, inverse, _ = _unique2(x, sorted, return_inverse, False)
    return out, inverse


def _unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    """torch.unique_consecutive without dim, as `_unique2` without the sort."""
    if dim is not None:
        from .fallback import cpu_fallback
        return cpu_fallback(torch.ops.aten.unique_consecutive.default, (x, return_inverse, return_counts, dim), {})
    empty = torch.zeros((0,), dtype=torch.int64, device=x.device)
    flat = x.reshape(-1)
    n = flat.shape[0]
    if n == 0:
        return flat, (torch.zeros(x.shape, dtype=torch.int64, device=x.device) if return_inverse else empty), empty
    starts, run = _runs(flat, flat)
    out = torch.ops.aten.index_select(flat, 0, starts)
    inverse = run.reshape(x.shape) if return_inverse else empty
    return out, inverse, _counts(starts, n) if return_counts else empty


def _saved_stats_in_input_dtype(name):
    """torch._decomp's decomposition of batch norm op `name` with the saved mean and rstd
    (outputs 1 and 2) in the input's dtype, as the CPU returns them (the decomposition
    keeps CUDA's float32)."""
    def fn(x, weight, bias, *args):
        from torch._decomp import decomposition_table
        packet, ov = name.split(".", 1)
        # The decomposition asks PyTorch for a backend with tensors in every slot.
        c = x.shape[1] if x.dim() > 1 else 1
        if weight is None:
            weight = torch.ones((c,), dtype=x.dtype, device=x.device)
        if bias is None:
            bias = torch.zeros((c,), dtype=x.dtype, device=x.device)
        out = list(decomposition_table[getattr(getattr(torch.ops.aten, packet), ov)](x, weight, bias, *args))
        out[1], out[2] = out[1].to(x.dtype), out[2].to(x.dtype)
        return tuple(out)
    return fn


def _multi_margin_loss(x, target, p=1, margin=1, weight=None, reduction=1):
    """torch._decomp's decomposition; a 1-D input's unreduced loss is 0-d, as on the CPU."""
    from torch._decomp import decomposition_table
    out = decomposition_table[torch.ops.aten.multi_margin_loss.default](x, target, p, margin, weight, reduction)
    return out.reshape(()) if x.dim() <= 1 and reduction == 0 else out


# The project's own decompositions of ops with data-dependent output shapes, which
# torch._decomp leaves out: everything but a `nonzero` (its count read by the host) runs
# on the device.
OWN = {
    "masked_select.default": _masked_select,
    "_unique2.default": _unique2,
    "_unique.default": _unique,
    "multi_margin_loss.default": _multi_margin_loss,
    "unique_consecutive.default": _unique_consecutive,
    "_batch_norm_with_update.default": _saved_stats_in_input_dtype("_batch_norm_with_update.default"),
    "_batch_norm_with_update_functional.default":
        _saved_stats_in_input_dtype("_batch_norm_with_update_functional.default"),
}


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
    for name, fn in OWN.items():
        if name not in lowered:
            packet, ov = name.split(".", 1)
            out[packet if ov == "default" else name] = DecompKernel(fn, name)
    return out
