"""PyTorch on XLA devices, on the XLA compiler and PJRT runtime of jaxlib."""
from __future__ import annotations

from ._engine import device as _device
from ._engine import dispatch as _dispatch
from ._engine import torch_patches as _torch_patches

_device.register()
_dispatch.register()
_torch_patches.install()

from ._api import (device, devices, device_count, sync, step, compile, manual_seed,  # noqa: E402
                   launch, real_devices, is_xla_tensor)

__version__ = "0.1.0"
