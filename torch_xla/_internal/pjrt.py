"""Running a function on every device of this host and collecting its results.

One process per device (the project's launcher, `_engine/launcher.py`): on CPU
`CPU_NUM_DEVICES` processes (1 when unset), elsewhere one process owning the host's
devices. On CPU process i's device is `xla:i` (its global ordinal, as PyTorch/XLA's thread
per device there), elsewhere `xla:0`.
"""
from __future__ import annotations

import collections
import os
import pickle
import tempfile
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from .._engine import boot as _boot, launcher as _launcher, pjrt as _runtime
from .. import runtime as xr

R = TypeVar("R")


def _merge_replica_results(replica_results: List[Tuple[int, R]]) -> Dict[int, R]:
    """`{ordinal: result}` from `[(ordinal, result), ...]`; AssertionError when an
    ordinal appears twice."""
    counts = collections.Counter(ordinal for ordinal, _ in replica_results)
    if counts:
        ordinal, n = counts.most_common(1)[0]
        assert n == 1, f"{n} results for replica {ordinal}"
    return dict(replica_results)


class _CallWithoutIndex:
    """Picklable `fn(*args, **kwargs)` that ignores the replica index the launcher passes.
    An exception it raises is also pickled into `errdir`, for the parent to raise again."""

    def __init__(self, fn: Callable[..., R], args: tuple, kwargs: dict, errdir: str):
        self.fn, self.args, self.kwargs, self.errdir = fn, args, kwargs, errdir

    def __call__(self, _index: int):
        rank = xr.global_ordinal()
        try:
            return rank, self.fn(*self.args, **self.kwargs)
        except Exception as e:
            try:
                with open(os.path.join(self.errdir, f"{rank}.pkl"), "wb") as f:
                    pickle.dump(e, f)
            except Exception:  # an exception that does not pickle: the launcher reports its text
                pass
            raise


def _first_child_exception(errdir: str) -> Optional[BaseException]:
    """The exception a replica raised first, of those that raised one."""
    files = sorted((os.stat(os.path.join(errdir, f)).st_mtime_ns, f) for f in os.listdir(errdir)
                   if f.endswith(".pkl"))
    for _, f in files:
        e = _child_exception(errdir, int(f[:-len(".pkl")]))
        if e is not None:
            return e
    return None


def _child_exception(errdir: str, rank: int) -> Optional[BaseException]:
    try:
        with open(os.path.join(errdir, f"{rank}.pkl"), "rb") as f:
            return pickle.load(f)
    except Exception:
        return None


def run_multiprocess(fn: Callable[..., R], *args, start_method: str = "spawn", **kwargs) -> Dict[int, R]:
    """Runs `fn(*args, **kwargs)` once per device of this host, one process each, and
    returns `{global ordinal: result}` (results must be picklable). A failing replica
    stops the others; its exception is raised here (or `ProcessFailedError` when it does
    not pickle). The calling process must
    not have started the runtime (used an xla device) before."""
    if _boot.started():
        raise RuntimeError("Runtime is already initialized. Do not use the XLA device before "
                           "calling run_multiprocess.")
    nprocs = _launcher.default_nprocs()
    with tempfile.TemporaryDirectory(prefix="torch_xla_run_") as errdir:
        context = _launcher.start_processes(_CallWithoutIndex(fn, args, kwargs, errdir), nprocs=nprocs,
                                            start_method=start_method)
        try:
            context.join()
        except _launcher.ProcessFailedError as failure:
            # The replica's own exception (TypeError, AssertionError...), with the launcher's
            # report (which replica, its traceback) as its cause.
            original = _child_exception(errdir, failure.rank)
            if original is None:  # e.g. the launcher blamed a peer that aborted when this one left
                original = _first_child_exception(errdir)
            if original is None:
                raise
            raise original from failure
    return _merge_replica_results([r for r in context.results().values() if r is not None])


class _SpawnFn:
    """Picklable `fn(global ordinal, *args)`."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args

    def __call__(self, _index: int = 0):
        return self.fn(xr.global_ordinal(), *self.args)


def spawn(fn: Callable, nprocs: Optional[int] = None, start_method: str = "spawn", args: tuple = ()) -> None:
    """`fn(global ordinal, *args)` on every device of this host (`nprocs=None`), or in this
    process (`nprocs=1`); any other `nprocs` is a ValueError."""
    if nprocs == 1:
        _SpawnFn(fn, args)()
        return
    if nprocs is not None:
        raise ValueError(f"Unsupported nprocs ({nprocs}): use nprocs=1 or None (one process per "
                         f"device; CPU_NUM_DEVICES sets how many CPU devices)")
    run_multiprocess(_SpawnFn(fn, args), start_method=start_method)


def spawn_threads(fn: Callable, args: tuple = ()) -> None:
    """`fn(index, *args)` on one thread per device of this process. A process drives its
    devices from one thread here, so this needs a process with a single device."""
    n = _runtime.device_count()
    if n != 1:
        raise RuntimeError(f"spawn_threads needs a process with one device, this one has {n}: run one "
                           f"process per device with run_multiprocess / xmp.spawn instead")
    _SpawnFn(fn, args)()


__all__ = ["run_multiprocess", "spawn", "spawn_threads", "_merge_replica_results"]
