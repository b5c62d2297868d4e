"""Exchanging tensors with other frameworks through DLPack (CPU device only)."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import DLDeviceType


def to_dlpack(xla_tensor: torch.Tensor) -> Any:
    """A DLPack capsule of the value of `xla_tensor` (its pending graph runs first)."""
    from .. import _XLAC
    return _XLAC._to_dlpack(xla_tensor)


def from_dlpack(ext_tensor: Any) -> torch.Tensor:
    """An xla tensor holding a copy of a DLPack capsule or of an object with `__dlpack__`."""
    if hasattr(ext_tensor, '__dlpack_device__') and hasattr(ext_tensor, '__dlpack__'):
        device_type, _ = ext_tensor.__dlpack_device__()
        if device_type != DLDeviceType.kDLCPU:
            raise ValueError("PyTorch/XLA DLPack implementation currently only supports CPU.")
    from .. import _XLAC
    return _XLAC._from_dlpack(ext_tensor)
