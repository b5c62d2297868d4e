"""Replica functions for tests/test_error_paths.py (importable, so the launcher can pickle
them). None of them starts jax: they test what the launcher does with their results."""
from __future__ import annotations

import sys
import threading


def _raise_on_load(text: str):
    raise ValueError(text)


class LoadsBadly:
    """Pickles in the replica; unpickling it (in the parent) raises ValueError."""

    def __reduce__(self):
        return _raise_on_load, ("this result refuses to be unpickled",)


def return_lock(index: int):
    """Replica 1 returns a lock (no pickle); replica 0 a plain value."""
    return threading.Lock() if index == 1 else index


def return_loads_badly(index: int):
    return LoadsBadly() if index == 1 else index


def exit_cleanly_on_one(index: int):
    """Replica 1 leaves through sys.exit(0) before returning."""
    if index == 1:
        sys.exit(0)
    return {"rank": index}


def default_store_job(index: int):
    """Store calls through torch.distributed's default store after init_process_group."""
    import gc
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401
    dist.init_process_group("xla", init_method="xla://")
    gc.collect()
    store = dist.distributed_c10d._get_default_store()
    store.set(f"from {index}", f"from {index}")
    got = [store.get(f"from {1 - index}"), store.get("from 1")]
    dist.destroy_process_group()
    return got


def lock_result():
    """For run_multiprocess (no replica index): a result that does not pickle."""
    return threading.Lock()
