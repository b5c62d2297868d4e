"""Preemption detection for `CheckpointManager`: a SIGTERM marks a sync point.

`sync_point_reached(step)` is True at the first step checked after this process (or,
with a torch.distributed process group of several processes, any of them) received a
SIGTERM while detection was active; every process then agrees on that step.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

_state: dict = {"active": False, "signaled": False, "previous": None, "step": None}


def _on_sigterm(signum: int, frame: Any) -> None:
    _state["signaled"] = True


def activate() -> None:
    """Starts detecting preemptions (a SIGTERM no longer ends the process at once)."""
    if _state["active"]:
        return
    if threading.current_thread() is not threading.main_thread():
        logging.warning("preemption detection needs the main thread; it stays off")
        return
    _state.update(active=True, signaled=False, step=None,
                  previous=signal.signal(signal.SIGTERM, _on_sigterm))


def deactivate() -> None:
    """Stops detecting preemptions and restores the previous SIGTERM handler."""
    if not _state["active"]:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _state["previous"] or signal.SIG_DFL)
    _state.update(active=False, signaled=False, previous=None, step=None)


def is_active() -> bool:
    return _state["active"]


def sync_point_reached(step: int, group: Optional[Any] = None) -> bool:
    """Whether `step` is the step at which every process checkpoints before preemption."""
    if not _state["active"]:
        return False
    if _state["step"] is not None:
        return step == _state["step"]
    flag = _state["signaled"]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flag = bool(t.item())
    if flag:
        _state["step"] = step
    return flag
