"""`StableHLOCompositeBuilder`: mark a pattern's inputs and outputs so that its StableHLO
(`xm.get_stablehlo`, `torch_xla.stablehlo`) holds it as one `stablehlo.composite` op."""
from __future__ import annotations

import uuid
from typing import Any, Dict, Optional, Tuple, Union

import torch

from . import xla_marker


@xla_marker._constant
def _new_id() -> str:
    return uuid.uuid4().hex


class StableHLOCompositeBuilder:
    """One pattern instance named `name` with attributes `attr` (str keys; str, float,
    int, bool values or lists of float / int / bool): call `mark_inputs` on its inputs,
    compute with the returned tensors, then `mark_outputs` on its results and use the
    returned tensors from there on."""

    def __init__(self, name: str, attr: Optional[Dict[str, Any]] = None):
        self.name = name
        self.attr = attr
        self.id = _new_id()

    def _mark(self, tensors, is_input: bool):
        attr = None if is_input else xla_marker.serialize_composite_attr(self.attr)
        out = []
        for pos, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"input must be a torch tensor. Got {type(t)}.")
            out.append(torch.ops.xla.mark_tensor(t, name=self.name, pos=pos, id=self.id, is_input=is_input,
                                                 attr=attr))
        return out[0] if len(out) == 1 else tuple(out)

    def mark_inputs(self, *tensors: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """The pattern's inputs, marked (use these in the pattern)."""
        return self._mark(tensors, True)

    def mark_outputs(self, *tensors: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """The pattern's outputs, marked (use these after the pattern)."""
        return self._mark(tensors, False)
