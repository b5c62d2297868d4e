"""Per-platform policies: what the executor does differently on CPU, GPU or TPU.

The executor asks the policy of the platform in use (`policy(name)`) a few things:
compiler options for a program, what to do around a compile and around a dispatch, and
whether convolutions are lowered as patch products (a flag the lowerings read from their
context). Every CPU-only choice lives in `cpu.py`; other platforms take the defaults
below, so a design here stays valid for GPU and TPU through PJRT plugins.
"""
from __future__ import annotations

from .base import Policy
from .cpu import CpuPolicy


_DEFAULT = Policy()
_policies = {}
__all__ = ["Policy", "CpuPolicy", "policy"]


def policy(platform_name: str) -> Policy:
    """The policy of a PJRT platform (CPU, CUDA, TPU...)."""
    p = _policies.get(platform_name)
    if p is None:
        if platform_name == "CPU":
            p = CpuPolicy()
        else:
            p = _DEFAULT
        _policies[platform_name] = p
    return p
