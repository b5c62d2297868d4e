"""Keeping an old function name callable while pointing users at its replacement."""
from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Callable, Optional, TypeVar

FN = TypeVar("FN", bound=Callable)


def deprecated(module: ModuleType, new: FN, old_name: Optional[str] = None,
               extra_msg: Optional[str] = None) -> FN:
    """`new`, wrapped so that its first call logs (logging.WARNING) that
    `module.old_name` is deprecated in favour of `new`."""
    old = old_name or new.__name__
    warned = []

    @functools.wraps(new)
    def wrapper(*args, **kwargs):
        if not warned:
            warned.append(True)
            msg = (f"{module.__name__}.{old} is deprecated. Use "
                   f"{getattr(new, '__module__', None)}.{getattr(new, '__name__', new)} instead.")
            if extra_msg:
                msg += " " + extra_msg
            logging.warning(msg)
        return new(*args, **kwargs)

    return wrapper


def mark_deprecated(new: FN, extra_msg: Optional[str] = None) -> Callable[[Callable], FN]:
    """Decorator: the decorated function is replaced by `new`, with a deprecation warning
    naming both at the first call."""

    def decorator(func: Callable) -> FN:
        return deprecated(importlib.import_module(func.__module__), new, old_name=func.__name__,
                          extra_msg=extra_msg)

    return decorator


def register_deprecated(module: ModuleType, new: FN, extra_msg: Optional[str] = None) -> None:
    """Makes `module.<new.__name__>` a deprecated alias of `new`."""
    setattr(module, new.__name__, deprecated(module, new, extra_msg=extra_msg))
