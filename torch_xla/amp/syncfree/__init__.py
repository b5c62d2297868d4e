"""Optimizers that skip a step inside the graph: `step(found_inf=t)` leaves parameters and
state unchanged where the device scalar `t` is non-zero, without reading it on the host.

They also follow PyTorch's `_step_supports_amp_scaling` contract, so `torch.amp.GradScaler`
hands them its scale and `found_inf` instead of reading the flag itself."""
from .adam import Adam  # noqa: F401
from .adamw import AdamW  # noqa: F401
from .sgd import SGD  # noqa: F401

__all__ = ["SGD", "Adam", "AdamW"]
