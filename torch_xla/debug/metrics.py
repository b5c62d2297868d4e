"""`torch_xla.debug.metrics`: counters and metrics of the runtime, and their report.

A counter counts events (`MarkStep`, `UncachedCompile`, `xla::<op>` for each traced op,
`aten::<op>` for each op run by the CPU fallback); a metric holds samples (times in
nanoseconds, sizes in bytes, numbers). Only active ones (counters not zero, metrics with
a sample since the last clear) are reported.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from .._engine import telemetry as _m
from .._engine.metrics_report import format_report

_SHORT_COUNTERS = ["CachedCompile", "UncachedCompile", "MarkStep", "DynamoSyncInputExecuteTime"]
_SHORT_METRICS = ["CompileTime", "ExecuteTime", "ExecuteReplicatedTime", "TransferToDeviceTime",
                  "TransferFromDeviceTime"]


def counter_names() -> List[str]:
    """All the currently active counter names."""
    return sorted(_m.counter_items())


def counter_value(name: str) -> Optional[int]:
    """The value of an active counter (None if it is not active)."""
    return _m.counter(name)


def metric_names() -> List[str]:
    """All the currently active metric names."""
    _m.settle()
    return sorted(_m.metrics)


def metric_data(name: str) -> Optional[Tuple[int, float, list]]:
    """(TOTAL_SAMPLES, ACCUMULATOR, SAMPLES) of a metric; SAMPLES are (time, value) pairs."""
    return _m.metric_data(name)


def metrics_report() -> str:
    """The full metrics and counters report."""
    return format_report(metric_names(), counter_names())


def short_metrics_report(counter_names: Optional[List[str]] = None,
                         metric_names: Optional[List[str]] = None) -> str:
    """A report of a few key metrics and counters (those named, or by default the compile,
    execute and transfer times, the compile cache's hits and misses and `MarkStep`), always followed by the
    CPU fallback counters (`aten::...`)."""
    _m.settle()   # the runs whose results were read, before the active metrics are picked
    counters = list(counter_names or _SHORT_COUNTERS)
    counters += [c for c in executed_fallback_ops() if c not in counters]
    return format_report([m for m in (metric_names or _SHORT_METRICS) if m in _m.metrics], counters)


def clear_counters() -> None:
    """Resets every counter (they become inactive)."""
    _m.clear_counters()


def clear_metrics() -> None:
    """Drops every metric's samples (they become inactive)."""
    _m.clear_metrics()


def clear_all() -> None:
    """Clears all counters and metrics."""
    _m.clear_counters()
    _m.clear_metrics()


def executed_fallback_ops() -> List[str]:
    """The ops that ran on the CPU fallback since the counters were last cleared
    (`aten::nonzero`, `torchvision::nms`, ...)."""
    return sorted(c for c in _m.counter_items()
                  if "::" in c and c.split("::")[0] not in ("xla", "decomposed"))


def recompilation_report() -> str:
    """Why graphs compiled again, by cause, with a suggestion each
    (`torch_xla.debug.recompilation`; on with PT_XLA_DEBUG_LEVEL>=1 or its `enable()`)."""
    from . import recompilation
    return recompilation.report()
