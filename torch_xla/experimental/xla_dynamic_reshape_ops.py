"""`torch.ops.xla.dynamic_view` and `torch.ops.xla.dynamic_expand`: a view / an expand
whose one dynamic output size is named by a dimension of another tensor.

An FX graph exported with a `torch.export.Dim` computes such a size from `aten.sym_size`
nodes; these ops carry where the size comes from (tensor, dimension, factor) instead,
so a consumer of the graph need not evaluate symbolic integers. On every device they
are the plain view / expand with that size (the xla device traces them as such; its
StableHLO export makes the size symbolic, `torch_xla.stablehlo`).
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from .._engine.kernels import library

__all__ = ["dynamic_view", "dynamic_expand"]

_VIEW = ("dynamic_view(Tensor input, SymInt[] size, Tensor src_tensor, int src_dim, int target_dim, "
         "float mul_scaler) -> Tensor")
_EXPAND = "dynamic_expand(Tensor input, SymInt[] size, Tensor src_tensor, int src_dim, int target_dim) -> Tensor"


def _sizes(size: Sequence, src: torch.Tensor, src_dim: int, target_dim: int, scale=1) -> List:
    out = list(size)
    out[target_dim] = src.shape[src_dim] * int(scale)
    return out


def _view(input: torch.Tensor, size: List, src_tensor: torch.Tensor, src_dim: int, target_dim: int,
          mul_scaler: float) -> torch.Tensor:
    # A view of an op's input would alias it, which an op without an alias annotation
    # must not do: the result is a new tensor (reshape of a copy when needed).
    return input.reshape(_sizes(size, src_tensor, src_dim, target_dim, mul_scaler)).clone()


def _expand(input: torch.Tensor, size: List, src_tensor: torch.Tensor, src_dim: int,
            target_dim: int) -> torch.Tensor:
    return input.expand(_sizes(size, src_tensor, src_dim, target_dim)).clone()


def _view_meta(input, size, src_tensor, src_dim, target_dim, mul_scaler):
    return input.new_empty(input.reshape(_sizes(size, src_tensor, src_dim, target_dim, mul_scaler)).shape)


def _expand_meta(input, size, src_tensor, src_dim, target_dim):
    return input.new_empty(input.expand(_sizes(size, src_tensor, src_dim, target_dim)).shape)


if not hasattr(torch.ops.xla, "dynamic_view"):
    library.define("xla", _VIEW)
    library.impl_ns("xla", "dynamic_view", _view, "CompositeExplicitAutograd")
    library.impl_ns("xla", "dynamic_view", _view_meta, "Meta")
if not hasattr(torch.ops.xla, "dynamic_expand"):
    library.define("xla", _EXPAND)
    library.impl_ns("xla", "dynamic_expand", _expand, "CompositeExplicitAutograd")
    library.impl_ns("xla", "dynamic_expand", _expand_meta, "Meta")


def dynamic_view(input: torch.Tensor, size: Sequence, src_tensor: torch.Tensor, src_dim: int, target_dim: int,
                 mul_scaler: float = 1) -> torch.Tensor:
    """`input.view(size)` with `size[target_dim] = src_tensor.shape[src_dim] * mul_scaler`."""
    return torch.ops.xla.dynamic_view(input, list(size), src_tensor, src_dim, target_dim, float(mul_scaler))


def dynamic_expand(input: torch.Tensor, size: Sequence, src_tensor: torch.Tensor, src_dim: int,
                   target_dim: int) -> torch.Tensor:
    """`input.expand(size)` with `size[target_dim] = src_tensor.shape[src_dim]`."""
    return torch.ops.xla.dynamic_expand(input, list(size), src_tensor, src_dim, target_dim)
