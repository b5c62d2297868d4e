"""Per-platform policies: what the executor does differently on CPU, GPU or TPU.

The executor asks the policy of the platform in use (`policy(name)`) a few things:
compiler options for a program, what to do around a compile and around a dispatch, and
whether convolutions are lowered as patch products (a flag the lowerings read from their
context). Every CPU-only choice lives in `cpu.py`; other platforms take the defaults
below, so a design here stays valid for GPU and TPU through PJRT plugins.
"""
from __future__ import annotations

from typing import Iterable, Tuple


class Policy:
    """The defaults: no options, nothing around compiles and dispatches."""
    name = "default"
    patch_convolutions = False

    def compiler_options(self, ops: Iterable[Tuple[str, tuple]]) -> dict:
        """XLA options for one program; `ops` yields (op name, first output aval)."""
        return {}

    def before_compile(self) -> None:
        pass

    def after_compile(self, seconds: float) -> None:
        pass

    def paced_bytes(self, compiled) -> int:
        """How much of a program's memory its dispatches must wait for (0: none)."""
        return 0

    def before_dispatch(self, paced: int):
        return None

    def after_dispatch(self, paced: int, token, outs) -> None:
        pass


_DEFAULT = Policy()
_policies = {}


def policy(platform_name: str) -> Policy:
    """The policy of a PJRT platform (CPU, CUDA, TPU...)."""
    p = _policies.get(platform_name)
    if p is None:
        if platform_name == "CPU":
            from .cpu import CpuPolicy
            p = CpuPolicy()
        else:
            p = _DEFAULT
        _policies[platform_name] = p
    return p
