"""`torch_xla.backends`: settings of the XLA backend.

`set_mat_mul_precision("default" | "high" | "highest")` chooses the precision of matrix
products and convolutions in programs compiled afterwards: on TPU, "default" is one pass
of bfloat16, "high" three passes (about float32's accuracy), "highest" six (float32's);
the CPU computes float32 in every case. The default here is "highest", so results match
PyTorch's CPU kernels.
"""
from __future__ import annotations

from typing import Literal

from .. import _XLAC

_PrecisionType = Literal["default", "high", "highest"]
__all__ = ["set_mat_mul_precision", "get_mat_mul_precision"]


def set_mat_mul_precision(precision: _PrecisionType) -> None:
    """Sets the precision of matrix products and convolutions (ValueError if unknown)."""
    _XLAC._xla_set_mat_mul_precision(precision)


def get_mat_mul_precision() -> _PrecisionType:
    """The precision of matrix products and convolutions."""
    return _XLAC._xla_get_mat_mul_precision()
