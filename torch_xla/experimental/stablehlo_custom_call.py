"""`stablehlo.custom_call` from PyTorch: a call of a target XLA (or a consumer of the
exported StableHLO) provides, and the host-offloading placement annotations built on it.

The call is one IR node of the graph: it prints and exports as a custom call of its
target; running it needs a backend that has the target (XLA has `annotate_device_placement`
on every platform).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._engine.kernels import engine_op, library

__all__ = ["stablehlo_custom_call", "place_to_host", "place_to_device",
           "extract_custom_call_outputs_shape_dtype"]


def stablehlo_custom_call(args: Sequence[torch.Tensor], call_target: str, output_shapes: Sequence[Sequence[int]],
                          output_dtypes: Sequence[torch.dtype], has_side_effect: bool = False,
                          backend_config: str = "", api_version: int = 0,
                          frontend_attributes: Optional[Dict[str, str]] = None
                          ) -> Union[torch.Tensor, List[torch.Tensor]]:
    """`stablehlo.custom_call @call_target(args)` with results of `output_shapes` /
    `output_dtypes` (one tensor for one output, else a list). `api_version` is XLA's
    `CustomCallApiVersion` (0 unspecified, 1 original, 2 status returning, 4 typed FFI);
    `frontend_attributes` become the op's `mhlo.frontend_attributes`."""
    args = list(args)
    if len(output_shapes) != len(output_dtypes):
        raise ValueError(f"stablehlo_custom_call: {len(output_shapes)} output shapes but "
                         f"{len(output_dtypes)} output dtypes")
    for a in args:
        if not isinstance(a, torch.Tensor) or a.device.type != "xla":
            raise RuntimeError(f"stablehlo_custom_call: arguments must be xla tensors, got "
                               f"{type(a).__name__ if not isinstance(a, torch.Tensor) else a.device}")
    attrs = tuple(sorted((str(k), str(v)) for k, v in (frontend_attributes or {}).items()))
    avals = [(tuple(int(d) for d in s), dt) for s, dt in zip(output_shapes, output_dtypes)]
    outs = engine_op("xla::custom_call", args,
                     (str(call_target), bool(has_side_effect), str(backend_config), int(api_version), attrs), avals)
    return outs[0] if len(outs) == 1 else list(outs)


def extract_custom_call_outputs_shape_dtype(n: torch.fx.Node) -> Tuple[list, list]:
    """The output shapes and dtypes of FX node `n` (from its `val` metadata)."""
    val = n.meta.get("val")
    if val is None:
        raise ValueError(f"node {n.name} has no 'val' metadata")
    if isinstance(val, torch.Tensor):
        return [val.shape], [val.dtype]
    if not all(isinstance(t, torch.Tensor) for t in val):
        raise ValueError(f"node {n.name}: every output must be a tensor")
    return [t.shape for t in val], [t.dtype for t in val]


def _placement(t: torch.Tensor, where: str) -> torch.Tensor:
    return stablehlo_custom_call([t], "annotate_device_placement", [t.shape], [t.dtype], has_side_effect=True,
                                 frontend_attributes={"_xla_buffer_placement": where})


class _Placement(torch.autograd.Function):
    """The annotation below autograd; its gradient passes through (the value does not
    change where it lives)."""

    @staticmethod
    def forward(ctx, t, op):  # noqa: ARG004  (autograd.Function's signature)
        with torch._C._AutoDispatchBelowAutograd():
            return op(t)

    @staticmethod
    def backward(ctx, grad):  # noqa: ARG004  (autograd.Function's signature)
        return grad, None


def _define(name: str, where: str) -> None:
    if hasattr(torch.ops.xla, name):
        return
    library.define("xla", f"{name}(Tensor t) -> Tensor")
    op = getattr(torch.ops.xla, name).default
    library.impl_ns("xla", name, lambda t: _placement(t, where), "PrivateUse1")
    library.impl_ns("xla", name, lambda t: t.clone(), "CompositeExplicitAutograd")
    library.impl_ns("xla", name, torch.empty_like, "Meta")
    library.impl_ns("xla", name, lambda t: _Placement.apply(t, op), "Autograd")


_define("place_to_host", "pinned_host")
_define("place_to_device", "device")


def place_to_host(t: torch.Tensor) -> torch.Tensor:
    """`t`, annotated to live in the host's pinned memory (XLA's host offloading);
    `torch.ops.xla.place_to_host`."""
    return torch.ops.xla.place_to_host(t)


def place_to_device(t: torch.Tensor) -> torch.Tensor:
    """`t`, annotated to live in device memory (the way back from `place_to_host`);
    `torch.ops.xla.place_to_device`."""
    return torch.ops.xla.place_to_device(t)
