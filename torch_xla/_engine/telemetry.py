"""Counters and metrics of the engine (the data behind `torch_xla.debug.metrics`).

A counter is a named integer. A metric is a named series of (time, value) samples
kept in a bounded ring, with the total sample count and the accumulated value.

Counters of per-op events (`xla::<op>`, `CreateXlaTensor`, `DestroyXlaTensor`) are
cells, one-element lists the hot path increments in place (`cell[0] += 1`), instead of
entries of `counters`; a counter is active (reported) while its value is not zero.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import deque
from typing import Dict, List, Optional, Tuple

from . import patches

MAX_SAMPLES = 1024
_lock = threading.Lock()


class Metric:
    __slots__ = ("name", "kind", "total_samples", "accumulator", "samples")

    def __init__(self, name: str, kind: str):
        self.name = name
        self.kind = kind  # "time" (nanoseconds) or "bytes" or "number"
        self.total_samples = 0
        self.accumulator = 0.0
        self.samples: deque = deque(maxlen=MAX_SAMPLES)

    def add(self, value: float) -> None:
        with _lock:
            self.total_samples += 1
            self.accumulator += value
            self.samples.append((time.time(), value))


counters: Dict[str, int] = {}
metrics: Dict[str, Metric] = {}
_cells: Dict[str, List[int]] = {}

# What kind of value each metric of the engine holds, for the report's formatting.
_KINDS = {
    "CompileTime": "time",
    "ExecuteTime": "time",
    "ExecuteReplicatedTime": "time",
    "TransferToDeviceTime": "time",
    "TransferFromDeviceTime": "time",
    "InboundData": "bytes",
    "OutboundData": "bytes",
    "TensorsGraphSize": "number",
    "IrGraphSize": "number",
    "TraceTime": "time",
    "LazyTracing": "time",
    "TensorToData": "time",
    "UnwrapXlaData": "time",
    "WrapXlaData": "time",
    "DeviceLockWait": "time",
    "EagerOpCompileTime": "time",
    "EagerOpExecuteTime": "time",
    "InputOutputAliasCount": "number",
}


def cell(name: str) -> List[int]:
    """The in-place counter `name` (one per name): the hot path does `cell[0] += 1`."""
    c = _cells.get(name)
    if c is None:
        c = _cells.setdefault(name, [counters.pop(name, 0)])
    return c


def inc(name: str, n: int = 1) -> None:
    """Adds `n` to counter `name` (created at zero on first use)."""
    c = _cells.get(name)
    if c is not None:
        c[0] += n
    else:
        counters[name] = counters.get(name, 0) + n


def counter_items() -> Dict[str, int]:
    """Every active counter and its value."""
    out = dict(counters)
    for name, c in list(_cells.items()):
        if c[0]:
            out[name] = c[0]
    return out


def counter(name: str) -> Optional[int]:
    """The value of an active counter, None when it is not active."""
    c = _cells.get(name)
    if c is not None:
        return c[0] or None
    return counters.get(name)


def snapshot_counters() -> Dict[str, int]:
    return counter_items()


def restore_counters(saved: Dict[str, int]) -> None:
    """Puts every counter back to its value in `saved` (a `snapshot_counters()`)."""
    counters.clear()
    for c in _cells.values():
        c[0] = 0
    for name, v in saved.items():
        c = _cells.get(name)
        if c is not None:
            c[0] = v
        else:
            counters[name] = v


def add_sample(name: str, value: float) -> None:
    m = metrics.get(name)
    if m is None:
        m = metrics.setdefault(name, Metric(name, _KINDS.get(name, "number")))
    m.add(value)


# Samples that end when a device computation finishes (ExecuteTime: dispatch is
# asynchronous, the run is not over when the call returns). One helper thread waits for
# each in turn; readers of the metrics `settle()` first, so a report made after a result
# was read includes that result's run.
_until_ready: "queue.Queue" = queue.Queue()
_waiter: List[threading.Thread] = []


def _wait_loop() -> None:
    while True:
        item = _until_ready.get()
        if item is None:
            _until_ready.task_done()
            return
        name, t0, array = item
        try:
            array.block_until_ready()
        except Exception:   # deleted (donated to a later run): it had finished
            pass
        add_sample(name, time.perf_counter_ns() - t0)
        _until_ready.task_done()


def add_sample_when_ready(name: str, t0: int, array) -> None:
    """Adds `perf_counter_ns() - t0` to metric `name` once `array` (a device buffer, or
    anything with `block_until_ready()`) holds its value."""
    if not _waiter:
        patches.install("metrics_ready_thread")
    _until_ready.put((name, t0, array))


def start_waiter() -> None:
    """Patch `metrics_ready_thread`: the thread that waits for results, and its exit hook."""
    th = threading.Thread(target=_wait_loop, name="xla-metrics-ready", daemon=True)
    th.start()
    _waiter.append(th)
    # Registered after jax started, so it runs before jax's own exit handlers: a thread
    # still inside block_until_ready when the interpreter finalizes would abort the process.
    atexit.register(_stop_waiter)


def _stop_waiter() -> None:
    _until_ready.put(None)
    # Bounded: a run that never finishes (peers gone) must not hang the exit.
    _waiter[0].join(timeout=30)


def settle() -> None:
    """Waits for the samples `add_sample_when_ready` still owes."""
    if _waiter and _until_ready.unfinished_tasks:
        _until_ready.join()


class timed:
    """Context manager adding the elapsed nanoseconds to a time metric."""
    __slots__ = ("name", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        add_sample(self.name, time.perf_counter_ns() - self.t0)
        return False


def clear_counters() -> None:
    counters.clear()
    for c in _cells.values():
        c[0] = 0


def clear_metrics() -> None:
    settle()
    metrics.clear()


def metric_data(name: str) -> Optional[Tuple[int, float, List[Tuple[float, float]]]]:
    settle()
    m = metrics.get(name)
    if m is None:
        return None
    with _lock:
        return m.total_samples, m.accumulator, list(m.samples)
