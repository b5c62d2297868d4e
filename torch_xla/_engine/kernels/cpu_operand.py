"""A CPU tensor (not 0-d) given to an op on xla tensors (`xla_x + cpu_y`).

PyTorch refuses mixed devices; PyTorch/XLA copies such an operand to the device, and user
code relies on it. Here `XLA_CPU_OPERAND` decides: `move` (the default) copies it at each
call, with a warning once per line of user code, since a host copy at every step is slow
and easily missed; `error` raises PyTorch's same-device RuntimeError. 0-d CPU tensors are
graph parameters either way (`plan._scalar_state`), as on every device.

Only the generic kernel reaches this: the specialised kernels hand any operand without XLA
state to it, so the common path pays nothing.
"""
from __future__ import annotations

import warnings
from typing import Set, Tuple

import torch

from .. import env_vars, ir, pjrt
from ..tensor import XlaState

_MODES = ("move", "error")
_warned: Set[Tuple[str, int]] = set()


def moves() -> bool:
    """Whether CPU operands are copied to the device (else PyTorch's error)."""
    mode = env_vars.get("XLA_CPU_OPERAND")
    if mode not in _MODES:
        raise ValueError(f"environment variable XLA_CPU_OPERAND={mode!r}: expected one of {', '.join(_MODES)}")
    return mode == "move"


def same_device_error(t: torch.Tensor, op_name: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"xla:{pjrt.device_index()} and {t.device}! (when checking argument for {op_name})")


def to_device(t: torch.Tensor, op_name: str) -> XlaState:
    """The state of a device copy of CPU tensor `t`, an operand of `op_name`; or the error."""
    if t.device.type != "cpu" or not moves():
        raise same_device_error(t, op_name)
    _warn(t, op_name)
    from .values import from_cpu
    return from_cpu(t)._xla


def _warn(t: torch.Tensor, op_name: str) -> None:
    filename, lineno, module = ir.user_site()
    site = (filename, lineno)
    if site in _warned:
        return
    _warned.add(site)
    shape = ",".join(str(d) for d in t.shape)
    warnings.warn_explicit(
        f"{op_name}: an operand is a CPU tensor ({t.dtype}[{shape}]) while the others are on the xla "
        f"device; it is copied to the device at every call of {site[0]}:{site[1]}. Move it there "
        f"once (`.to('xla')`), or set XLA_CPU_OPERAND=error to make this PyTorch's same-device error.",
        UserWarning, filename, lineno, module=module)
