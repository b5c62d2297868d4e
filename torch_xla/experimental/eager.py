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
def eager_mode_context(enable: bool) -> Iterator[bool]:
    """Sets the default execution mode inside the block (yields the previous one) and
    restores it afterwards."""
    saved = is_eager_mode()
    eager_mode(enable)
    try:
        yield saved
    finally:
        eager_mode(saved)
