"""`xmp.spawn`: run a function once per XLA device, one process each.

    import torch_xla.distributed.xla_multiprocessing as xmp
    xmp.spawn(_mp_fn, args=(flags,))

With PJRT_DEVICE=CPU the number of processes is CPU_NUM_DEVICES (default 1). With one
process the function runs in the calling process. Under torchrun no process is started:
`fn(local_rank, *args)` runs in the torchrun-started process. A replica that fails stops
the others and raises `ProcessFailedError` here, with the replica's traceback.
"""
from __future__ import annotations

from typing import Callable, Optional

from .._engine.launcher import ProcessContext, ProcessFailedError  # noqa: F401
from .._engine import launcher as _launcher


def spawn(fn: Callable, args: tuple = (), nprocs: Optional[int] = None, join: bool = True,
          daemon: bool = False, start_method: str = "spawn"):
    """Runs `fn(index, *args)` on every device (one process per device).

    Args:
      fn: the function each replica runs; `index` is the replica's local ordinal.
      args: extra arguments for `fn` (must be picklable).
      nprocs: how many processes; None means one per device, 1 runs `fn(0, *args)` here.
      join: wait for the replicas (otherwise a ProcessContext is returned).
      daemon: start the processes as daemons.
      start_method: a multiprocessing start method ('spawn' by default; the parent never
        initialises jax, so 'fork' and 'forkserver' also work).

    Returns:
      With one process, `fn`'s result; with several and join=True, None.
    """
    return _launcher.spawn(fn, args=args, nprocs=nprocs, join=join, daemon=daemon,
                           start_method=start_method)


def MpModelWrapper(model):
    """Kept for compatibility: with one process per device the model is used as is."""
    return _ModelWrapper(model)


class _ModelWrapper:
    def __init__(self, model):
        self._model = model

    def to(self, device):
        return self._model.to(device)


class MpSerialExecutor:
    """Runs a function serially across the replicas of this host (compatibility shim)."""

    def __init__(self):
        import threading
        self._lock = threading.Lock()

    def run(self, fn):
        with self._lock:
            return fn()
