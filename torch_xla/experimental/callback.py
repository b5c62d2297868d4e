"""Running Python code when the device buffer of an xla tensor is ready."""
from __future__ import annotations

import threading
from typing import Callable

import torch

from .._engine import executor as _executor
from .._engine.tensor import state_of as _state_of


def on_ready_callback(tensor: torch.Tensor, callback: Callable[[torch.Tensor], None]) -> None:
    """Calls `callback(tensor)` on another thread once `tensor`'s device buffer holds its
    value. A tensor whose value is still pending is waited for until a barrier (or a host
    read) computes it. The callback must not block on the thread that holds the GIL
    waiting for it."""
    if not (isinstance(tensor, torch.Tensor) and tensor.device.type == "xla"):
        raise RuntimeError(f"on_ready_callback expects an xla tensor, got {type(tensor).__name__} "
                           f"on {getattr(tensor, 'device', None)}")
    _executor.on_ready(_state_of(tensor), lambda: callback(tensor))


def on_ready_event(tensor: torch.Tensor) -> threading.Event:
    """A `threading.Event` set once `tensor`'s device buffer holds its value."""
    event = threading.Event()
    on_ready_callback(tensor, lambda _: event.set())
    return event
