"""`torch_xla.amp.autocast`: `torch.autocast("xla")` with PyTorch/XLA's defaults."""
from __future__ import annotations

from typing import Optional, Union

import torch


class autocast(torch.amp.autocast_mode.autocast):
    """`torch.autocast` for an xla device; `dtype` defaults to torch.bfloat16.

    Under it, matrix products and convolutions run in `dtype`, softmax, losses, norms and
    a few precision-sensitive ops in float32 (`torch_xla._engine.kernels.autocast`)."""

    def __init__(self, device: Union[str, torch.device] = "xla", enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, cache_enabled: bool = True):
        if "xla" not in str(device):
            raise AssertionError("torch_xla.amp.autocast is available for xla devices only")
        super().__init__("xla", enabled=enabled, dtype=torch.bfloat16 if dtype is None else dtype,
                         cache_enabled=cache_enabled)
