"""Execution modes: eager or lazy tracing, and SPMD.

Eager mode runs each op as it is traced (`torch_xla.experimental.eager_mode`); a
`torch_xla.compile`d function traces lazily whatever the default.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from . import env_vars


class _Modes:
    """The process's modes, read by the kernels on every op (one slot read, no lock).

    `spmd`: one program over all devices (`xr.use_spmd()`), partitioned by XLA; set once,
    by `partitioning.enable`, before the first tensor. `eager`: run ops as they are traced
    now; `eager_default`: the mode outside lazy scopes. Both written by the thread that
    calls `set_eager` or enters `lazy_scope` (a process-wide setting, as in PyTorch/XLA)."""
    __slots__ = ("spmd", "eager", "eager_default")

    def __init__(self):
        self.spmd = False
        self.eager = False
        self.eager_default = False


modes = _Modes()


class _Depth(threading.local):
    lazy = 0


_depth = _Depth()


def set_eager(enable: bool) -> None:
    """Sets the default execution mode: eager (True) or lazy (False)."""
    modes.eager_default = bool(enable)
    modes.eager = bool(enable) and _depth.lazy == 0


def is_eager_default() -> bool:
    return modes.eager_default


@contextlib.contextmanager
def lazy_scope() -> Iterator[None]:
    """Traces lazily inside the block, whatever the default mode."""
    _depth.lazy += 1
    saved = modes.eager
    modes.eager = False
    try:
        yield
    finally:
        _depth.lazy -= 1
        modes.eager = saved if _depth.lazy else modes.eager_default


def spmd_requested() -> bool:
    """Whether SPMD mode is on or was asked for (`XLA_USE_SPMD`)."""
    return modes.spmd or bool(env_vars.get("XLA_USE_SPMD"))
