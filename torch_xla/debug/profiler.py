"""`torch_xla.debug.profiler` (xp): trace annotations and profiling, on jax's profiler.

`Trace(name)` / `StepTrace(name, step_num=...)` annotate host code; `trace_me(name)` (or
`Trace(name)` itself) decorates a function. A trace is captured in this process with
`start_trace(log_dir)` ... `stop_trace()`, or from a profiler server (`start_server(port)`)
with `trace(service_addr, log_dir, duration_ms)` / `trace_detached(...)`. Traces are
written as TensorBoard's profile plugin reads them (`log_dir/plugins/profile/<run>/
<host>.xplane.pb`, with a `<host>.trace.json.gz` that Perfetto opens). Besides the
user's annotations they hold the engine's phases: `torch_xla::sync`,
`torch_xla::build_graph`, `torch_xla::lower`, `torch_xla::compile`, `torch_xla::execute`,
`torch_xla::transfer_to_device` and `torch_xla::transfer_from_device`.
"""
from __future__ import annotations

import functools
import os
import socket
import threading
import time
from typing import Any, Callable, Optional, Union

from .._engine import executor, ir, job, pjrt
from .._engine.executor import analysis


class _Server:
    """This process's profiler server (`start_server`) and its port. Written under `_lock`
    by the thread that starts it; `port` is also read without it by the threads that call
    `trace` (a server starting meanwhile is reached through the client instead)."""
    __slots__ = ("server", "port")

    def __init__(self):
        self.server = None
        self.port: Optional[int] = None


class _StepMark:
    """`marked`: whether a `StepTrace` marked a step (`set_tracer_marked_step`). Written and
    read by any thread, without a lock."""
    __slots__ = ("marked",)

    def __init__(self):
        self.marked = False


_server = _Server()
_step_mark = _StepMark()
_lock = threading.Lock()


def _profiler():
    pjrt.jax_module()
    import jax.profiler
    return jax.profiler


def set_tracer_marked_step(value: bool) -> None:
    """Records whether a `StepTrace` marked a step (read by `get_tracer_marked_step`)."""
    _step_mark.marked = bool(value)


def get_tracer_marked_step() -> bool:
    return _step_mark.marked


class Trace:
    """Annotates the code inside with `name` in profiles: a context manager, or a decorator
    (`@xp.Trace("fwd")`). Keyword arguments are shown as the event's metadata. The region
    must not contain a barrier (`torch_xla.sync()` / `xm.mark_step()` raise RuntimeError in
    it): a host read, or a `StepTrace` around the step, runs the graph instead."""

    def __init__(self, name: str, **kwargs: Any):
        self.name = name
        self.kwargs = kwargs
        self._ann = None

    def __enter__(self) -> "Trace":
        self._ann = _profiler().TraceAnnotation(self.name, **self.kwargs)
        self._ann.__enter__()
        ir.push_scope(self.name)
        return self

    def __exit__(self, *exc) -> bool:
        ir.pop_scope()
        self._ann.__exit__(*exc)
        return False

    def __call__(self, fn: Callable) -> Callable:
        name, kwargs = self.name, self.kwargs

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            with Trace(name, **kwargs):
                return fn(*args, **kw)
        return wrapper


class StepTrace(Trace):
    """A `Trace` marking one training step (`step_num`) for the profile viewer; leaving it
    runs the barrier (`torch_xla.sync()`), so the step's graph runs inside it."""

    def __init__(self, name: str, step_num: Optional[int] = None, **kwargs: Any):
        super().__init__(name, **kwargs)
        self.step_num = step_num

    def __enter__(self) -> "StepTrace":
        set_tracer_marked_step(True)
        kw = dict(self.kwargs)
        if self.step_num is not None:
            kw["step_num"] = self.step_num
        self._ann = _profiler().StepTraceAnnotation(self.name, **kw)
        self._ann.__enter__()
        ir.push_scope(self.name)
        return self

    def __exit__(self, *exc) -> bool:
        ir.pop_scope()  # closed before its own barrier, which checks that none is open
        try:
            if exc[0] is None:
                ir.reset_scopes()
                with analysis.cause("torch_xla.sync when exiting a profiler StepTrace region"):
                    executor.sync()
        finally:
            self._ann.__exit__(*exc)
        return False


def trace_me(name: str) -> Callable:
    """Decorator: each call of the function is annotated as `name`."""
    return Trace(name)


def start_server(port: int, only_on_master: bool = True):
    """Starts the profiler server on `port`: TensorBoard's profile plugin (or `trace`)
    captures traces of this process through it. With `only_on_master`, only the process of
    local rank 0 starts one (others return None). Starting it again on the same port
    returns the running server; another port is an error (one server per process)."""
    if only_on_master and job.local_ordinal() != 0:
        return None
    with _lock:
        if _server.server is not None:
            if _server.port == port:
                return _server.server
            raise RuntimeError(f"a profiler server already runs on port {_server.port} "
                               f"(one per process); cannot start one on {port}")
        _server.server = _profiler().start_server(port)
        _server.port = port
        return _server.server


def _options(host_tracer_level: int, python_tracer_level: int):
    prof = _profiler()
    opts = prof.ProfileOptions()
    opts.host_tracer_level = host_tracer_level
    opts.python_tracer_level = python_tracer_level
    return opts


def start_trace(log_dir: Union[str, os.PathLike], host_tracer_level: int = 2, python_tracer_level: int = 0) -> None:
    """Starts capturing a trace of this process into `log_dir` (only one at a time:
    RuntimeError "Only one profile may be run at a time." otherwise).

    `python_tracer_level=1` also records every Python function call (large traces: the
    viewer keeps the first million events); by default the trace holds the annotations
    (`Trace`, the engine's phases) and the runtime's own events."""
    _profiler().start_trace(str(log_dir), profiler_options=_options(host_tracer_level, python_tracer_level))


def stop_trace() -> None:
    """Stops the trace started by `start_trace` and writes it (RuntimeError "No profile
    started" when none is running)."""
    _profiler().stop_trace()


def _is_this_process(service_addr: str) -> bool:
    host, _, port = service_addr.rpartition(":")
    host = host.strip("[]")
    if _server.port is None or not port.isdigit() or int(port) != _server.port:
        return False
    try:
        addr = socket.gethostbyname(host or "localhost")
    except OSError:
        return False
    return addr.startswith("127.") or addr in ("0.0.0.0", socket.gethostbyname(socket.gethostname()))


def trace(service_addr: str, logdir: str, duration_ms: int = 1000, num_tracing_attempts: int = 3,
          host_tracer_level: int = 2, device_tracer_level: int = 1, delay_ms: int = 0,
          timeout_s: int = 120, interval_s: int = 5) -> None:
    """Captures `duration_ms` of trace from the profiler server at `service_addr`
    (`host:port`, started with `start_server`) into `logdir`; blocks until it is written.

    A server of this very process is traced directly. Another process's server is reached
    through the `xprof` package's client (`pip install xprof`), which retries
    `num_tracing_attempts` times."""
    if delay_ms:
        time.sleep(delay_ms / 1000)
    if _is_this_process(service_addr):
        _trace_here(logdir, duration_ms, host_tracer_level)
        return
    try:
        from xprof.convert import _pywrap_profiler_plugin
    except ImportError:
        raise RuntimeError(
            f"xp.trace({service_addr!r}): capturing another process's trace needs the profiler "
            f"service client of the `xprof` package (pip install xprof); TensorBoard's profile "
            f"plugin (\"Capture Profile\") captures it too, and xp.start_trace(log_dir) in the "
            f"traced process needs neither") from None
    opts = {"host_tracer_level": host_tracer_level, "device_tracer_level": device_tracer_level,
            "python_tracer_level": 1}
    deadline = time.time() + timeout_s
    while True:
        try:
            _pywrap_profiler_plugin.trace(service_addr.replace("grpc://", ""), str(logdir), "", True,
                                          duration_ms, num_tracing_attempts, opts)
            return
        except Exception:  # noqa: BLE001  (the server may not be up yet: retried until timeout_s)
            if time.time() + interval_s > deadline:
                raise
            time.sleep(interval_s)


def _trace_here(logdir: str, duration_ms: int, host_tracer_level: int) -> None:
    from jax._src.lib import _profiler as lib
    session = lib.ProfilerSession(_options(host_tracer_level, 0))
    time.sleep(duration_ms / 1000)
    session.stop_and_export(str(logdir))


def trace_detached(*args: Any, **kwargs: Any) -> threading.Thread:
    """`trace(...)` in a background thread (returned, started)."""
    t = threading.Thread(target=trace, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t
