"""`torch_xla.debug.profiler` (xp): trace annotations and profiling, on jax's profiler.

`Trace(name)` / `StepTrace(name, step_num=...)` annotate host code (they show in traces
captured with `start_trace(log_dir)` ... `stop_trace()` or from `start_server(port)`);
`trace_me(name)` annotates a function.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from .._engine import runtime


def _profiler():
    runtime.jax_module()
    import jax.profiler
    return jax.profiler


class Trace:
    """Context manager annotating the code inside with `name` in profiles."""

    def __init__(self, name: str, **kwargs: Any):
        self.name = name
        self.kwargs = kwargs
        self._ann = None

    def __enter__(self) -> "Trace":
        self._ann = _profiler().TraceAnnotation(self.name, **self.kwargs)
        self._ann.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._ann.__exit__(*exc)
        return False


class StepTrace(Trace):
    """A `Trace` marking one training step (`step_num`) for the profile viewer."""

    def __init__(self, name: str, step_num: Optional[int] = None, **kwargs: Any):
        super().__init__(name, **kwargs)
        self.step_num = step_num

    def __enter__(self) -> "StepTrace":
        kw = dict(self.kwargs)
        if self.step_num is not None:
            kw["step_num"] = self.step_num
        self._ann = _profiler().StepTraceAnnotation(self.name, **kw)
        self._ann.__enter__()
        return self


def trace_me(name: str) -> Callable:
    """Decorator: each call of the function is annotated as `name`."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)
        return wrapper
    return deco


def start_server(port: int, only_on_master: bool = True):
    """Starts the profiler server on `port` (a trace can then be captured remotely)."""
    return _profiler().start_server(port)


def start_trace(log_dir: str) -> None:
    """Starts capturing a trace of this process into `log_dir` (TensorBoard format)."""
    _profiler().start_trace(log_dir)


def stop_trace() -> None:
    """Stops the trace started by `start_trace` and writes it."""
    _profiler().stop_trace()
