"""The top-level `torch_xla` functions: devices, barriers, compile, launch, seeds."""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, List, Optional, Set, Union

import torch

from ._engine import executor, ir, job, telemetry, mode, rng, pjrt
from ._engine import tensor as _tensor
from ._engine.executor import analysis, graph_limit


def device(index: Optional[int] = None) -> torch.device:
    """Returns a given instance of an XLA device: this process's device by default.

    `index` counts this process's devices (`torch_xla.devices()`), as in PyTorch/XLA: in
    a multi-process job on CPU, process i has one device, `xla:i`, which `device()` and
    `device(0)` return."""
    if index is None:
        return torch.device("xla", pjrt.device_index())
    mine = pjrt.device_indices()
    if index < 0 or index >= max(len(mine), 1):
        raise IndexError(f"xla device index {index} out of range: this process has {len(mine)} "
                         f"device(s), {', '.join(f'xla:{i}' for i in mine)}")
    return torch.device("xla", mine[index])


def devices() -> List[torch.device]:
    """All XLA devices visible to this process."""
    return [torch.device("xla", i) for i in pjrt.device_indices()]


def device_count() -> int:
    """The number of XLA devices visible to this process."""
    return pjrt.device_count()


def real_devices() -> List[str]:
    """The hardware devices behind this process's XLA devices, e.g. ['CPU:0'] (named by
    their xla index: process i of a multi-process CPU job has 'CPU:i')."""
    p = pjrt.platform()
    return [f"{p}:{i}" for i in pjrt.device_indices()]


def _real_devices_of(devices: List[Union[str, torch.device]]) -> List[str]:
    """The hardware devices behind xla devices `devices` of this process (`real_devices()`
    by position; another process's device is a RuntimeError)."""
    real = real_devices()
    return [real[_device_position(d)] for d in devices]


def _device_position(d: Union[str, torch.device]) -> int:
    """The position of xla device `d` among this process's devices (`devices()`); an index
    without a device here (another process's) is a RuntimeError."""
    d = torch.device(d)
    if d.index is None:
        return 0
    mine = pjrt.device_indices()
    if d.index not in mine:
        raise RuntimeError(pjrt.device_error(d))
    return mine.index(d.index)


def _own_device_position(fn: str, d: Union[str, torch.device]) -> int:
    """`_device_position` of `d`, which must be an xla device (RuntimeError otherwise, as
    PyTorch/XLA's device check raises)."""
    dev = torch.device(d)
    if dev.type != "xla":
        raise RuntimeError(f"{fn}: {d} is not an xla device")
    return _device_position(dev)


# Per-device requests served process-wide, already warned about: each warns once per process.
_WARNED: Set[str] = set()


def _warn_once(key: str, message: str, stacklevel: int) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)


def _rng_device(fn: str, device: Optional[Union[str, torch.device]]) -> None:
    """Checks the `device` of a random-number-generator call: one of this process's xla
    devices. PyTorch/XLA keeps a generator per device; here one generator serves all of
    this process's devices, so naming another than the first (a process with several
    devices outside SPMD mode) warns once."""
    if device is not None and _own_device_position(fn, device) != 0:
        _warn_once("rng_device", f"{fn}: device={str(device)!r}: this process's devices share one random number "
                   f"generator, so this also changes what the other devices draw", stacklevel=3)


def is_xla_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """Launches all pending graph operations (the barrier, same as `xm.mark_step()`).

    reset_scope: refuse to run inside a profiler `Trace` region (RuntimeError), as
    PyTorch/XLA does; False skips that check."""
    if reset_scope:
        ir.reset_scopes()
    executor.sync(wait=wait)


@contextlib.contextmanager
def _step_cm():
    with analysis.cause("torch_xla.step: the pending graph before the step"):
        sync()
    try:
        yield
    finally:
        with analysis.cause("torch_xla.step at step end"):
            sync()


def step():
    """Wraps one training step: pending work is launched on entry and on exit.

    Usable as `with torch_xla.step():` or as a decorator.
    """
    return _step_cm()


class _Compiled:
    def __init__(self, fn: Callable, full_graph: bool, name: Optional[str],
                 max_different_graphs: Optional[int], limit_name: str = "max_different_graphs"):
        self.fn = fn
        self.full_graph = full_graph
        self.name = name or getattr(fn, "__name__", "compiled")
        self.allowed = max_different_graphs
        self.limit_name = limit_name
        functools.update_wrapper(self, fn)

    def __get__(self, obj, objtype=None):
        # As a method decorator: bound to the instance like a function.
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args, **kwargs):
        with analysis.cause("torch_xla.compile clear the pending graph prior calling the target function",
                            f"{self.name}_clear_pending"):
            sync()
        before = telemetry.counters.get("ExecuteCount", 0)
        with mode.lazy_scope():
            result = self.fn(*args, **kwargs)
        if self.full_graph:
            extra = telemetry.counters.get("ExecuteCount", 0) - before
            if extra:
                raise RuntimeError(
                    f"torch_xla.compile({self.name!r}, full_graph=True): Unexpected execution happens inside "
                    f"the compiled function, exiting: it was split into {extra + 1} graphs (a host read: "
                    f"item(), print, .cpu(), or a CPU fallback forced execution before the end)")
        if self.allowed is not None:
            self._count_graph()
        with analysis.cause("torch_xla.compile", self.name):
            sync()
        return result

    def _count_graph(self) -> None:
        order = _pending_order()
        values = graph_limit.values_of(order) if order else []
        try:
            _graph_session(self.fn, self.name).add(values, self.allowed)
        except RuntimeError as e:
            raise RuntimeError(f"{e}(in the function {self.name!r} compiled by torch_xla.compile with "
                               f"{self.limit_name}={self.allowed})") from None


# (name, id(fn)) -> the graphs that function traced; `_graph_owners` tells whether the id
# still names the same function (a dead local function's id may be reused by another).
_graph_sessions: dict = {}
_graph_owners: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _graph_session(fn: Callable, name: str) -> "graph_limit.Session":
    key = (name, id(fn))
    if _graph_owners.get(key) is not fn:
        _graph_sessions[key] = graph_limit.Session()
        try:
            _graph_owners[key] = fn
        except TypeError:   # not weakly referenceable: the session lives as long as the process
            pass
    return _graph_sessions[key]


def _pending_order() -> list:
    live = _tensor.pending.take_live()
    _tensor.pending.restore(live)
    roots, seen = [], set()
    for s in live:
        k = (id(s.node), s.idx)
        if k not in seen:
            seen.add(k)
            roots.append((s.node, s.idx))
    return executor.Graph(roots).order if roots else []


def compile(f: Optional[Callable] = None, full_graph: bool = False, name: Optional[str] = None,
            max_different_graphs: Optional[int] = None,
            num_different_graphs_allowed: Optional[int] = None):
    """Compiles `f` with the lazy tensor tracer: one graph per call, launched at return.

    With `full_graph=True`, an execution forced inside `f` is an error; with
    `max_different_graphs=n` (`num_different_graphs_allowed` is the same), a call whose
    ops would make an (n+1)-th different graph of `f` raises RuntimeError naming the op
    where it left the graphs traced before.
    """
    limit_name = "max_different_graphs"
    if max_different_graphs is None and num_different_graphs_allowed is not None:
        max_different_graphs, limit_name = num_different_graphs_allowed, "num_different_graphs_allowed"
    if f is None:
        return functools.partial(compile, full_graph=full_graph, name=name, **{limit_name: max_different_graphs})
    return _Compiled(f, full_graph, name, max_different_graphs, limit_name)


def manual_seed(seed: int, device: Optional[torch.device] = None) -> None:
    """Seeds the device random number generator (`device`: an xla device of this process)."""
    _rng_device("manual_seed", device)
    rng.set_seed(seed)


def launch(fn: Callable, args: tuple = (), start_method: str = "spawn", debug_single_process: bool = False):
    """Runs `fn(index, *args)` once per device, one process each.

    With one device (PJRT_DEVICE=CPU and CPU_NUM_DEVICES unset or 1) or
    `debug_single_process=True`, `fn(0, *args)` runs in this process. Under torchrun no
    process is started: `fn(local_rank, *args)` runs here. A replica that fails stops the
    others and raises here, naming the replica, with its traceback.
    """
    from ._engine import launcher
    if job.under_torchrun() or job.in_launched_child():
        return launcher.spawn(fn, args=args, start_method=start_method)
    if debug_single_process:
        return fn(0, *args)
    return launcher.spawn(fn, args=args, nprocs=None, start_method=start_method)
