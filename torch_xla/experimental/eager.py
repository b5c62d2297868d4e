"""Eager mode: each op runs as it is called, except inside `torch_xla.compile`d functions."""
from __future__ import annotations

import contextlib
from typing import Iterator

from .._engine import mode as _mode

lazy_scope = _mode.lazy_scope


def eager_mode(enable: bool) -> None:
    """Configures the default execution mode: eager (True) or lazy (False)."""
    _mode.set_eager(enable)


def is_eager_mode() -> bool:
    return _mode.is_eager_default()


@contextlib.contextmanager
def eager_mode_context(enable: bool) -> Iterator[None]:
    """Sets the default execution mode (eager when `enable`) inside the block, then restores it."""
    saved = _mode.is_eager_default()
    _mode.set_eager(enable)
    try:
        yield
    finally:
        _mode.set_eager(saved)
