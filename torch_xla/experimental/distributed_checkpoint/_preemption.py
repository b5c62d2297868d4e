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


class _Detection:
    """`active`: detection is on; `signaled`: a SIGTERM arrived since; `previous`: the
    SIGTERM handler it replaced; `step`: the agreed sync point, once one is reached.
    `activate` / `deactivate` write them in the main thread (the only one that may set
    signal handlers), the SIGTERM handler sets `signaled` (Python runs it in the main
    thread too), `sync_point_reached` reads them and sets `step` in the thread that calls
    it. No lock."""
    __slots__ = ("active", "signaled", "previous", "step")

    def __init__(self):
        self.reset()

    def reset(self, active: bool = False, previous: Any = None) -> None:
        self.active = active
        self.signaled = False
        self.previous = previous
        self.step: Optional[int] = None


_detection = _Detection()


def _on_sigterm(_signum: int, _frame: Any) -> None:
    _detection.signaled = True


def activate() -> None:
    """Starts detecting preemptions (a SIGTERM no longer ends the process at once)."""
    if _detection.active:
        return
    if threading.current_thread() is not threading.main_thread():
        logging.warning("preemption detection needs the main thread; it stays off")
        return
    _detection.reset(active=True, previous=signal.signal(signal.SIGTERM, _on_sigterm))


def deactivate() -> None:
    """Stops detecting preemptions and restores the previous SIGTERM handler."""
    if not _detection.active:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _detection.previous or signal.SIG_DFL)
    _detection.reset()


def is_active() -> bool:
    return _detection.active


def sync_point_reached(step: int, group: Optional[Any] = None) -> bool:
    """Whether `step` is the step at which every process checkpoints before preemption."""
    if not _detection.active:
        return False
    if _detection.step is not None:
        return step == _detection.step
    flag = _detection.signaled
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flag = bool(t.item())
    if flag:
        _detection.step = step
    return flag
