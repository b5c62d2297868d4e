"""This process's place in a multi-process job (one process per device).

Set by the launcher through the environment (TORCH_XLA_JAX_* variables) or by
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); one process alone is
ordinal 0 of 1.
"""
from __future__ import annotations

import os


def _env_int(*names, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def world_size() -> int:
    return _env_int("TORCH_XLA_JAX_WORLD_SIZE", "WORLD_SIZE", default=1)


def global_ordinal() -> int:
    return _env_int("TORCH_XLA_JAX_PROCESS_ID", "RANK", default=0)


def local_ordinal() -> int:
    return _env_int("TORCH_XLA_JAX_LOCAL_RANK", "LOCAL_RANK", default=global_ordinal())


def local_process_count() -> int:
    return _env_int("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", default=world_size())


def master_ip() -> str:
    addr = os.environ.get("TORCH_XLA_JAX_COORDINATOR") or os.environ.get("MASTER_ADDR")
    if addr:
        return addr.split(":")[0]
    return "127.0.0.1"
