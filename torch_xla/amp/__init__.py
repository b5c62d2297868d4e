"""Automatic mixed precision on xla devices: `autocast`, `GradScaler`, `syncfree` optimizers.

`torch.autocast("xla", dtype=torch.bfloat16)` works too (the policy is registered on the
AutocastPrivateUse1 key, `_engine/kernels/autocast.py`)."""
from .autocast_mode import autocast  # noqa: F401
from .grad_scaler import GradScaler  # noqa: F401
from . import syncfree  # noqa: F401

__all__ = ["autocast", "GradScaler", "syncfree"]
