"""The package's `torch.library` handles: every kernel registration goes through here."""
from __future__ import annotations

import warnings
from typing import Callable, Dict

import torch

_libs: Dict[str, torch.library.Library] = {}


def _lib(ns: str = "aten") -> torch.library.Library:
    lib = _libs.get(ns)
    if lib is None:
        lib = _libs[ns] = torch.library.Library(ns, "IMPL")
    return lib


def impl(name: str, fn: Callable, key: str) -> None:
    """Registers `fn` as the kernel of aten overload `name` for dispatch key `key`."""
    _lib().impl(name, fn, key)


def replace(name: str, fn: Callable, key: str) -> None:
    """Registers `fn` over a kernel this package registered before (a second library:
    a library cannot register one (op, key) twice)."""
    lib = _libs.get("aten:replace")
    if lib is None:
        lib = _libs["aten:replace"] = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl(name, fn, key)


def override(name: str, fn: Callable, key: str) -> None:
    """Registers `fn` over one of PyTorch's own kernels (the patch registry lists each)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        _override_lib().impl(name, fn, key)


def _override_lib() -> torch.library.Library:
    lib = _libs.get("aten:override")
    if lib is None:
        lib = _libs["aten:override"] = torch.library.Library("aten", "IMPL")
    return lib


def define(ns: str, schema: str) -> None:
    """Defines operator `schema` in namespace `ns` (this package's own ops)."""
    lib = _libs.get(ns + ":def")
    if lib is None:
        lib = _libs[ns + ":def"] = torch.library.Library(ns, "FRAGMENT")
    lib.define(schema)


def impl_ns(ns: str, name: str, fn: Callable, key: str) -> None:
    """Registers `fn` as the kernel of this package's op `ns::name` for dispatch key `key`."""
    _libs[ns + ":def"].impl(name, fn, key)


def fallback(fn: Callable, key: str) -> None:
    """Registers `fn(op, *args, **kwargs)` for every op without a kernel for `key`."""
    lib = _libs.get("_")
    if lib is None:
        lib = _libs["_"] = torch.library.Library("_", "IMPL")
    lib.fallback(fn, key)
