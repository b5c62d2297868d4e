"""Eager mode: each op runs as it is called, except inside `torch_xla.compile`d functions."""
from __future__ import annotations

import contextlib
import threading

from .._engine import dispatch


class _State(threading.local):
    lazy_depth = 0


_state = _State()


def eager_mode(enable: bool) -> None:
    """Configures the default execution mode: eager (True) or lazy (False)."""
    dispatch.EAGER[0] = bool(enable) and _state.lazy_depth == 0
    dispatch.EAGER_DEFAULT[0] = bool(enable)


def is_eager_mode() -> bool:
    return dispatch.EAGER_DEFAULT[0]


@contextlib.contextmanager
def lazy_scope():
    """Traces lazily inside, whatever the default mode."""
    _state.lazy_depth += 1
    saved = dispatch.EAGER[0]
    dispatch.EAGER[0] = False
    try:
        yield
    finally:
        _state.lazy_depth -= 1
        dispatch.EAGER[0] = saved if _state.lazy_depth else dispatch.EAGER_DEFAULT[0]
