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


def impl_foreign(ns: str, name: str, fn: Callable, key: str) -> None:
    """Registers `fn` as the kernel of another library's op `ns::name` for dispatch key
    `key` (PyTorch's `torch_nn::` and `quantized_decomposed::` ops; the op may be defined
    after this call, when its module is imported)."""
    _lib(ns).impl(name, fn, key)


def fallback(fn: Callable, key: str) -> None:
    """Registers `fn(op, *args, **kwargs)` for every op without a kernel for `key`."""
    lib = _libs.get("_")
    if lib is None:
        lib = _libs["_"] = torch.library.Library("_", "IMPL")
    lib.fallback(fn, key)


def derivative(ns: str, name: str, backward: Callable, setup_context: Callable) -> None:
    """Registers the derivative of this package's op `ns::name` (`torch.library.register_autograd`)."""
    torch.library.register_autograd(f"{ns}::{name}", backward, setup_context=setup_context, lib=_libs[ns + ":def"])


def side_effectful(ns: str, name: str) -> None:
    """Keeps this package's op `ns::name` in FX graphs when its result is unused (an op that
    acts on its input, which graph passes' dead-code elimination would otherwise drop)."""
    from torch.fx import node as fx_node
    fx_node._side_effectful_functions.add(getattr(getattr(torch.ops, ns), name).default)
