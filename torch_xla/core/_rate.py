"""`xm.RateTracker`: samples-per-second rates for training logs.

`add(count)` accumulates processed samples; `rate()` reports the (smoothed) rate
since the previous `rate()` call and starts a new interval; `global_rate()` reports
the average rate since the tracker was created. Times are wall-clock seconds.
"""
from __future__ import annotations

import time
from typing import Optional


class RateTracker:
    """Tracks a rate (count per second), with exponential smoothing of interval rates.

    Args:
      smooth_factor (float, optional): weight of the previous reported rate in a new
        report: ``rate = (1 - smooth_factor) * interval_rate + smooth_factor * previous``.
        Default: 0.4.
    """

    def __init__(self, smooth_factor: Optional[float] = None):
        self._smooth_factor = 0.4 if smooth_factor is None else float(smooth_factor)
        self._start_time = time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0   # samples already accounted for in a reported interval
        self._partial_rate: Optional[float] = None
        self._count = 0.0           # samples added since the last report

    def add(self, count) -> None:
        """Records `count` more processed samples."""
        self._count += count

    def _smooth(self, current_rate: float) -> float:
        if self._partial_rate is None:
            return current_rate
        return (1.0 - self._smooth_factor) * current_rate + self._smooth_factor * self._partial_rate

    def rate(self) -> float:
        """The smoothed rate of the interval since the last call (0.0 if no time passed)."""
        now = time.time()
        delta = now - self._partial_time
        if delta <= 0:
            return 0.0
        report = self._smooth(self._count / delta)
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = report
        return report

    def global_rate(self) -> float:
        """The average rate since the tracker was created."""
        delta = time.time() - self._start_time
        count = self._partial_count + self._count
        return count / delta if delta > 0 else 0.0
