"""The argument plan of one aten overload: what each argument is to the engine.

Both kernels of an overload, the generic one (`op_kernel.OpKernel.__call__`, a loop over
the plan) and the specialised one (`specialise.specialise`, straight-line code generated
from the same plan), read the schema only through this object, so they build the same
cache key and the same node.

Argument kinds:
- TENSOR / OPT_TENSOR: an operand of the node (a 0-d CPU tensor or a Python number in a
  TENSOR slot is a wrapped scalar: a graph parameter);
- TENSOR_LIST / OPT_TENSOR_LIST: a tuple of operand references;
- SCALAR / OPT_SCALAR: a graph parameter (0 and 1 are compiled in, see below);
- STATIC: everything else, and Scalars the lowering declares `static`: part of the program.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .. import config, job

TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST, SCALAR, OPT_SCALAR, STATIC = range(7)
KIND_NAMES = ("TENSOR", "OPT_TENSOR", "TENSOR_LIST", "OPT_TENSOR_LIST", "SCALAR", "OPT_SCALAR", "STATIC")
_KIND_OF_TYPE = {
    "Tensor": TENSOR, "Optional[Tensor]": OPT_TENSOR, "List[Tensor]": TENSOR_LIST,
    "List[Optional[Tensor]]": OPT_TENSOR_LIST, "number": SCALAR, "Optional[number]": OPT_SCALAR,
}
TENSOR_KINDS = (TENSOR, OPT_TENSOR, TENSOR_LIST, OPT_TENSOR_LIST)


def special_scalars() -> bool:
    """Whether 0 and 1 are compiled into programs (other Python scalars are parameters).

    In a multi-process job every replica must compile the same program for its
    collectives to match, and a value like `rank * 10` would differ between them: there
    all scalars are parameters, as with XLA_NO_SPECIAL_SCALARS."""
    return not config.get("XLA_NO_SPECIAL_SCALARS") and job.world_size() <= 1


class ArgPlan:
    """Names, kinds and defaults of an overload's arguments, in schema order."""
    __slots__ = ("names", "kinds", "defaults", "has_default", "kwarg_only", "index_of",
                 "signature", "nargs", "is_factory")

    def __init__(self, op: torch._ops.OpOverload, static: frozenset):
        args = op._schema.arguments
        self.names: List[str] = [a.name for a in args]
        self.signature: List[Tuple[str, str]] = [(a.name, str(a.type)) for a in args]
        self.kinds: Tuple[int, ...] = tuple(
            STATIC if a.name in static else _KIND_OF_TYPE.get(str(a.type), STATIC) for a in args)
        self.has_default: List[bool] = [a.has_default_value() for a in args]
        self.defaults: List[Any] = [a.default_value if a.has_default_value() else None for a in args]
        self.kwarg_only: List[bool] = [a.kwarg_only for a in args]
        self.index_of: Dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.nargs = len(args)
        # Factories (no tensor inputs) are called outside functionalization: their
        # results are wrapped for the user.
        self.is_factory = not any(k in TENSOR_KINDS for k in self.kinds)

    def describe(self) -> str:
        return ", ".join(f"{n}:{KIND_NAMES[k]}" for n, k in zip(self.names, self.kinds))
