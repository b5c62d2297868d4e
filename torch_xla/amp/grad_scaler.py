"""`torch_xla.amp.GradScaler`: PyTorch's GradScaler for xla devices, sync-free with the
`syncfree` optimizers.

The inf/NaN check (`_amp_foreach_non_finite_check_and_unscale_`) and the scale update
(`_amp_update_scale_`) are device ops. With an optimizer whose `step` takes `found_inf`
(the `syncfree` ones) the step is skipped inside the graph: no value is read back to the
host. Any other optimizer needs the flag on the host, as with PyTorch's GradScaler.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` on the xla device (see the module docstring)."""

    def __init__(self, device: str = "xla", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 use_zero_grad: bool = False) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.use_zero_grad = use_zero_grad

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict, *args: Any,
                        **kwargs: Any) -> Optional[float]:
        if "found_inf" in inspect.signature(optimizer.step).parameters:
            found = list(optimizer_state["found_inf_per_device"].values())
            kwargs["found_inf"] = torch.stack([f.to(self._device) for f in found]).sum()
            return optimizer.step(*args, **kwargs)
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
