"""Kernels of the AutocastPrivateUse1 key: `torch.autocast("xla")`'s op policy.

The op lists are PyTorch/XLA's (its `AutocastXLA` registrations): ops in LOWER_PRECISION
run in the autocast dtype, ops in FP32 in float32, ops in PROMOTE in the widest floating
dtype of their inputs; every other op runs in its inputs' dtypes (the key falls through).
Only floating-point xla tensors other than float64 are cast, as PyTorch's autocast does.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

LOWER_PRECISION = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
    "baddbmm", "addmm", "addbmm", "linear", "matmul", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "relu", "max_pool2d", "einsum",
)
FP32 = (
    "batch_norm", "_softmax", "softmax.int", "softmax.Dimname", "log_softmax.int", "log_softmax.Dimname",
    "binary_cross_entropy", "pow.Tensor_Scalar", "prod", "prod.dim_int", "prod.dim_Dimname", "cdist",
    "trace", "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div", "multilabel_margin_loss",
    "binary_cross_entropy_with_logits", "qr", "svd", "triangular_solve", "multilabel_margin_loss_forward",
    "linalg_svd", "linalg_inv_ex",
)
PROMOTE = ("stack", "cat", "index_copy", "index_copy.dimname")

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "xla" and t.is_floating_point()
            and t.dtype != torch.float64)


def _cast(v, dtype):
    if _eligible(v):
        return v if v.dtype == dtype else v.to(dtype)
    if isinstance(v, (list, tuple)) and v and any(_eligible(x) for x in v):
        return type(v)(_cast(x, dtype) for x in v)
    return v


def _widest(args, kwargs):
    dt = None
    for v in list(args) + list(kwargs.values()):
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if _eligible(x):
                dt = x.dtype if dt is None else torch.promote_types(dt, x.dtype)
    return dt


def _kernel(op, policy: str) -> Callable:
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if policy == "lower":
                dt = torch.get_autocast_dtype("xla")
            elif policy == "fp32":
                dt = torch.float32
            else:
                dt = _widest(args, kwargs)
            if dt is not None:
                args = tuple(_cast(a, dt) for a in args)
                kwargs = {k: _cast(v, dt) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return kernel


def kernels() -> Dict[str, Callable]:
    """{overload name: kernel} for every op of the policy that this PyTorch has."""
    out = {}
    for names, policy in ((LOWER_PRECISION, "lower"), (FP32, "fp32"), (PROMOTE, "promote")):
        for name in names:
            packet, _, ov = name.partition(".")
            pk = getattr(torch.ops.aten, packet, None)
            op = getattr(pk, ov or "default", None) if pk is not None else None
            if op is not None:
                out[name] = _kernel(op, policy)
    return out
