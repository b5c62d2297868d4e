"""`torch_xla.backends`: settings of the XLA backend (as `torch.backends.*` are PyTorch's).

`set_mat_mul_precision("default" | "high" | "highest")` chooses the precision of matrix
products and convolutions of float32 operands in programs compiled afterwards: on TPU,
"default" is one pass of bfloat16, "high" three passes (about 14 bits of mantissa),
"highest" six (about 22 bits); the CPU computes float32 in every case. The default here
is "highest", so results match PyTorch's CPU kernels.
"""
from __future__ import annotations

import logging
from typing import Final, Literal

from .. import _XLAC

logger = logging.getLogger(__name__)
# Each change recompiles every program (the precision is part of how graphs are lowered),
# and a precision changed between the steps of one model is rarely what was meant.
_WARNING_MESSAGE: Final[str] = (
    "Setting mat mul precision multiple times is not recommended. If you need to do so, "
    "please empirically verify that the precision setting is behaving as expected.")

_DEFAULT: Final = "default"
_HIGH: Final = "high"
_HIGHEST: Final = "highest"
_PRECISIONS: Final = (_DEFAULT, _HIGH, _HIGHEST)
_PrecisionType = Literal["default", "high", "highest"]
__all__ = ["set_mat_mul_precision", "get_mat_mul_precision"]


def set_mat_mul_precision(precision: _PrecisionType) -> None:
    """Sets the precision of matrix products and convolutions of 32-bit inputs.

    precision: "default" (fastest, least precise), "high" or "highest" (slowest, most
    precise). ValueError for anything else. Logs a warning at every call; a change
    recompiles every program at its next run.
    """
    if precision not in _PRECISIONS:
        raise ValueError(f"Invalid precision: {precision}. Must be one of {_DEFAULT}, {_HIGH}, {_HIGHEST}.")
    logger.warning(_WARNING_MESSAGE)
    _XLAC._xla_set_mat_mul_precision(precision)


def get_mat_mul_precision() -> _PrecisionType:
    """The precision of matrix products and convolutions: "default", "high" or "highest"."""
    precision = _XLAC._xla_get_mat_mul_precision()
    assert precision in _PRECISIONS, f"Invalid precision: {precision}"
    return precision
