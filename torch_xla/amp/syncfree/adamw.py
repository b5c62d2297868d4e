"""`torch_xla.amp.syncfree.AdamW`."""
from __future__ import annotations

import torch

from .adam import AdamRule


class AdamW(AdamRule, torch.optim.AdamW):
    """torch.optim.AdamW whose `step(found_inf=t)` is skipped inside the graph where the
    device scalar `t` is non-zero (`found_inf=None`: torch.optim.AdamW's step)."""
