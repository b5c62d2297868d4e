"""Execution modes: eager or lazy tracing, and SPMD.

Eager mode runs each op as it is traced (`torch_xla.experimental.eager_mode`); a
`torch_xla.compile`d function traces lazily whatever the default. The flags are plain
lists because the kernels' hot path reads them on every op.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from . import env_vars

# SPMD[0]: one program over all devices (`xr.use_spmd()`), partitioned by XLA.
SPMD = [False]
# EAGER[0]: run ops as they are traced now; EAGER_DEFAULT[0]: the mode outside lazy scopes.
EAGER = [False]
EAGER_DEFAULT = [False]


class _Depth(threading.local):
    lazy = 0


_depth = _Depth()


def set_eager(enable: bool) -> None:
    """Sets the default execution mode: eager (True) or lazy (False)."""
    EAGER_DEFAULT[0] = bool(enable)
    EAGER[0] = bool(enable) and _depth.lazy == 0


def is_eager_default() -> bool:
    return EAGER_DEFAULT[0]


@contextlib.contextmanager
def lazy_scope() -> Iterator[None]:
    """Traces lazily inside the block, whatever the default mode."""
    _depth.lazy += 1
    saved = EAGER[0]
    EAGER[0] = False
    try:
        yield
    finally:
        _depth.lazy -= 1
        EAGER[0] = saved if _depth.lazy else EAGER_DEFAULT[0]


def spmd_requested() -> bool:
    """Whether SPMD mode is on or was asked for (`XLA_USE_SPMD`)."""
    return SPMD[0] or bool(env_vars.get("XLA_USE_SPMD"))
