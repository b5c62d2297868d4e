"""`torch_xla.debug.metrics`: counters and metrics of the runtime, and their report."""
from __future__ import annotations

from typing import List, Optional, Tuple

from .._engine import metrics as _m
from .._engine.metrics_report import format_report


def counter_names() -> List[str]:
    """All the currently active counter names."""
    return sorted(_m.counters)


def counter_value(name: str) -> Optional[int]:
    """The value of an active counter (None if it does not exist)."""
    return _m.counters.get(name)


def metric_names() -> List[str]:
    """All the currently active metric names."""
    return sorted(_m.metrics)


def metric_data(name: str) -> Optional[Tuple[int, float, list]]:
    """(TOTAL_SAMPLES, ACCUMULATOR, SAMPLES) of a metric; SAMPLES are (time, value) pairs."""
    return _m.metric_data(name)


def metrics_report() -> str:
    """The full metrics and counters report."""
    return format_report(metric_names(), counter_names())


def short_metrics_report(counter_names: Optional[list] = None, metric_names: Optional[list] = None) -> str:
    """A report of a few key metrics and counters (or of the ones named)."""
    if metric_names is None:
        metric_names = ["CompileTime", "ExecuteTime", "TransferToDeviceTime", "TransferFromDeviceTime"]
    if counter_names is None:
        counter_names = ["CachedCompile", "UncachedCompile"] + [c for c in sorted(_m.counters) if c.startswith("aten::")]
    return format_report([m for m in metric_names if m in _m.metrics],
                         [c for c in counter_names if c in _m.counters])


def clear_counters() -> None:
    _m.clear_counters()


def clear_metrics() -> None:
    _m.clear_metrics()


def clear_all() -> None:
    """Clears all counters and metrics."""
    _m.clear_counters()
    _m.clear_metrics()


def executed_fallback_ops() -> List[str]:
    """The aten ops that ran on the CPU fallback."""
    return [c for c in sorted(_m.counters) if c.startswith("aten::")]
