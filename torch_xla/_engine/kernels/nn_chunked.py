"""xla kernels of PyTorch's chunked `linear_cross_entropy` ops (`torch_nn::`).

PyTorch's own kernels of these custom ops accumulate each chunk's results by writing into
`out.narrow(...)` views. They run below functionalization, on the device's inner tensors,
which share no storage with their views: the writes would be lost. Here the same results
(loss and, for the scalar reductions, the gradients the op precomputes) come from whole
tensor expressions, which XLA fuses without materialising more than the logits.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import library

_NS = "torch_nn"


def _loss_terms(input, linear_weight, target, linear_bias, weight, ignore_index: int, acc_dtype):
    """(logits, softmax, per-sample weight (0 where ignored), per-sample target index,
    per-sample unweighted loss) in `acc_dtype`."""
    x = input.to(acc_dtype)
    w = linear_weight.to(acc_dtype)
    logits = x @ w.t()
    if linear_bias is not None:
        logits = logits + linear_bias.to(acc_dtype)
    valid = target != ignore_index
    idx = torch.where(valid, target, torch.zeros_like(target))
    per_weight = valid.to(acc_dtype)
    if weight is not None:
        per_weight = per_weight * weight.to(acc_dtype)[idx]
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
    return x, w, logits, per_weight, idx, lse - picked


def chunked(input, linear_weight, target, linear_bias: Optional[torch.Tensor], weight: Optional[torch.Tensor],
            reduction: str, ignore_index: int, label_smoothing: float, batch_chunk_size: int, acc_policy: str,
            acc_dtype, allow_retain_graph: bool, compute_input_grad: bool, compute_linear_weight_grad: bool,
            compute_linear_bias_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scalar-reduction op: (loss, d loss/d input, d loss/d linear_weight,
    d loss/d linear_bias), a gradient not asked for being an empty tensor."""
    del label_smoothing, batch_chunk_size, acc_policy, allow_retain_graph  # 0 / chunking choices
    if reduction not in ("mean", "sum"):
        raise NotImplementedError(f"linear_cross_entropy does not support {reduction=}")
    x, w, logits, per_weight, idx, per_loss = _loss_terms(input, linear_weight, target, linear_bias, weight,
                                                          ignore_index, acc_dtype)
    total = (per_loss * per_weight).sum()
    scale = per_weight
    if reduction == "mean":
        denom = per_weight.sum()
        total = total / denom
        scale = per_weight / denom
    dt = input.dtype
    dlogits = torch.softmax(logits, dim=-1)
    dlogits = (dlogits - torch.nn.functional.one_hot(idx, logits.shape[-1]).to(dlogits.dtype)) * scale.unsqueeze(1)
    gi = (dlogits @ w).to(dt) if compute_input_grad else input.new_empty((0, 0))
    gw = (dlogits.t() @ x).to(dt) if compute_linear_weight_grad else input.new_empty((0, 0))
    gb = dlogits.sum(0).to(dt) if compute_linear_bias_grad else input.new_empty((0,))
    return total.to(dt), gi, gw, gb


def chunked_no_reduction(input, linear_weight, target, linear_bias: Optional[torch.Tensor],
                         weight: Optional[torch.Tensor], ignore_index: int, batch_chunk_size: int,
                         acc_policy: str, acc_dtype) -> torch.Tensor:
    """The `reduction='none'` op: the per-sample loss (0 where the target is ignored)."""
    del batch_chunk_size, acc_policy
    _, _, _, per_weight, _, per_loss = _loss_terms(input, linear_weight, target, linear_bias, weight,
                                                   ignore_index, acc_dtype)
    return (per_loss * per_weight).to(input.dtype)


def register() -> None:
    library.impl_foreign(_NS, "_linear_cross_entropy_batch_chunked", chunked, "PrivateUse1")
    library.impl_foreign(_NS, "_linear_cross_entropy_batch_chunked_no_reduction", chunked_no_reduction,
                         "PrivateUse1")
