"""Pattern boundaries for StableHLO composites: `torch.ops.xla.mark_tensor`.

`torch.ops.xla.mark_tensor(x, name, pos, id, is_input, attr=None)` marks `x` as input
(or output) number `pos` of instance `id` of pattern `name`; the StableHLO of the graph
holds each marked instance as one `stablehlo.composite "name"` op whose attributes come
from the output marks' `attr` (made by `serialize_composite_attr`). Off the xla device
the op is a copy. `mark_pattern_utils.StableHLOCompositeBuilder` is the friendly form.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch

from .._engine.kernels.compiled_ops import check_composite_attr
import torch_xla  # noqa: F401  (registers torch.ops.xla.mark_tensor)


@dataclasses.dataclass
class BoundaryMetadata:
    """What one mark says: pattern name, position, instance id, side and attributes."""
    name: str
    pos: int
    id: str
    is_input: bool = True
    attr: Optional[dict] = None


def _constant(fn):
    # Dynamo evaluates these once while tracing and keeps the result as a constant.
    try:
        import torch._dynamo as dynamo
    except ImportError:   # pragma: no cover - torch always ships dynamo
        return fn
    return dynamo.assume_constant_result(fn)


@_constant
def serialize_composite_attr(attr: Optional[Dict[str, Any]]) -> Optional[tuple]:
    """The attributes as the op's `attr` argument ((key, value) pairs); ValueError for
    anything but str keys and str / float / int / bool values or lists of one of those."""
    if attr is None:
        return None
    if not isinstance(attr, dict):
        raise ValueError("Composite attr must be a Python dictionary.")
    pairs = tuple(attr.items())
    check_composite_attr(pairs)
    return pairs


@_constant
def deserialize_composite_attr(attr) -> Optional[dict]:
    """The inverse of `serialize_composite_attr`."""
    return None if attr is None else dict(attr)


def mark_tensor(x: torch.Tensor, name: str, pos: int, id: str, is_input: bool, attr=None) -> torch.Tensor:
    """`torch.ops.xla.mark_tensor` (see the module docstring)."""
    return torch.ops.xla.mark_tensor(x, name, pos, id, is_input, attr)
