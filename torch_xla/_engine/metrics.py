"""Counters and metrics of the engine (the data behind `torch_xla.debug.metrics`).

A counter is a named integer. A metric is a named series of (time, value) samples
kept in a bounded ring, with the total sample count and the accumulated value.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Dict, List, Optional, Tuple

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
}


def inc(name: str, n: int = 1) -> None:
    """Adds `n` to counter `name` (created at zero on first use)."""
    counters[name] = counters.get(name, 0) + n


def add_sample(name: str, value: float) -> None:
    m = metrics.get(name)
    if m is None:
        m = metrics.setdefault(name, Metric(name, _KINDS.get(name, "number")))
    m.add(value)


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


def clear_metrics() -> None:
    metrics.clear()


def metric_data(name: str) -> Optional[Tuple[int, float, List[Tuple[float, float]]]]:
    m = metrics.get(name)
    if m is None:
        return None
    with _lock:
        return m.total_samples, m.accumulator, list(m.samples)
