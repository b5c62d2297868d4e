"""Auto-wrap policies and recursive wrapping, for any wrapper class.

A policy is called as `policy(module=m, recurse=bool, unwrapped_params=n)`: with
`recurse=True` it says whether to look inside `m`, with `recurse=False` whether to wrap
`m` itself, `n` being the number of parameters of `m` not wrapped yet. Nothing here
depends on a particular wrapper (the multi-process FSDP and the SPMD FSDPv2 share it):
a module that is already a wrapper (an instance of `wrapper_cls`, or any module with a
true `_xla_fsdp_wrapper` attribute) is left as it is.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Generator, Optional, Set, Tuple, Type

import torch.nn as nn

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "recursive_wrap", "wrap", "enable_wrap"]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:  # noqa: ARG001 (a policy's arguments, not needed)
    """Wraps every submodule."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool,
                            unwrapped_params: int,  # noqa: ARG001 (a policy's signature)
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wraps the modules for which `lambda_fn(module)` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool,
                                 unwrapped_params: int,  # noqa: ARG001 (a policy's signature)
                                 transformer_layer_cls: Set[Type[nn.Module]]) -> bool:
    """Wraps every instance of the classes in `transformer_layer_cls`."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: Optional[Set[Type[nn.Module]]] = None,
                                exclude_wrap_modules: Optional[Set[Type[nn.Module]]] = None) -> bool:
    """Wraps a module holding at least `min_num_params` unwrapped parameters; never looks
    inside `force_leaf_modules` (default: MultiheadAttention) nor wraps
    `exclude_wrap_modules` (default: ModuleList, ModuleDict)."""
    force_leaf_modules = (size_based_auto_wrap_policy.FORCE_LEAF_MODULES
                          if force_leaf_modules is None else force_leaf_modules)
    exclude_wrap_modules = (size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES
                            if exclude_wrap_modules is None else exclude_wrap_modules)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def _wrap(module: nn.Module, wrapper_cls: Callable, **kwargs: Any) -> nn.Module:
    overrides = getattr(module, "wrapper_config", None)
    if overrides:
        kwargs = {**kwargs, **overrides}
    return wrapper_cls(module, **kwargs)


def recursive_wrap(module: nn.Module, auto_wrap_policy: Callable, wrapper_cls: Callable,
                   ignored_modules: Set[nn.Module], ignored_params: Set[nn.Parameter],
                   only_wrap_children: bool = False, **kwargs: Any) -> Tuple[nn.Module, int]:
    """Wraps the children of `module` bottom-up as `auto_wrap_policy` decides, then
    `module` itself unless `only_wrap_children`. Returns (module, parameters wrapped)."""
    if getattr(module, "_xla_fsdp_wrapper", False) or (
            isinstance(wrapper_cls, type) and isinstance(module, wrapper_cls)):
        return module, 0
    num_params = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not auto_wrap_policy(module=module, recurse=True, unwrapped_params=num_params):
        return module, 0
    total = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        wrapped, n = recursive_wrap(child, auto_wrap_policy, wrapper_cls, ignored_modules, ignored_params,
                                    **kwargs)
        setattr(module, name, wrapped)
        total += n
    remainder = num_params - total
    if not only_wrap_children and auto_wrap_policy(module=module, recurse=False, unwrapped_params=remainder):
        return _wrap(module, wrapper_cls, **kwargs), num_params
    return module, total


class _WrapConfig:
    in_context = False
    wrapper_cls: Optional[Callable] = None
    kwargs: Dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Callable, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Within this context `wrap(module)` wraps with `wrapper_cls(module, **wrapper_kwargs)`."""
    if _WrapConfig.in_context:
        raise NotImplementedError("You are already within an autowrap context and we currently do not "
                                  "supported nested autowrap.")
    _WrapConfig.in_context, _WrapConfig.wrapper_cls, _WrapConfig.kwargs = True, wrapper_cls, dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapConfig.in_context, _WrapConfig.wrapper_cls, _WrapConfig.kwargs = False, None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wraps `module` inside an `enable_wrap` context; returns it unchanged outside."""
    if not _WrapConfig.in_context:
        return module
    return _wrap(module, _WrapConfig.wrapper_cls, **{**_WrapConfig.kwargs, **wrap_overrides})
