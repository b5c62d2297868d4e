"""The text format of the metrics report (TotalSamples, Accumulator, Rate, Percentiles)."""
from __future__ import annotations

from . import telemetry as _m


def _fmt_time(ns: float) -> str:
    ns = float(ns)
    parts = []
    units = [("d", 86400e9), ("h", 3600e9), ("m", 60e9), ("s", 1e9), ("ms", 1e6)]
    for u, size in units:
        if ns >= size:
            k = int(ns // size)
            ns -= k * size
            parts.append(f"{k:02d}{u}" if u not in ("ms",) else f"{k:03d}{u}")
    parts.append(f"{ns / 1e3:07.3f}us" if parts else f"{ns / 1e3:.3f}us")
    return "".join(parts)


def _fmt_bytes(b: float) -> str:
    for u, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= size:
            return f"{b / size:.2f}{u}"
    return f"{b:.0f}B"


def _fmt(kind: str, v: float) -> str:
    if kind == "time":
        return _fmt_time(v)
    if kind == "bytes":
        return _fmt_bytes(v)
    return f"{v:.2f}"


def _percentiles(values, kind):
    vs = sorted(values)
    out = []
    for p in (1, 5, 10, 20, 50, 80, 90, 95, 99):
        i = min(len(vs) - 1, int(round(p / 100 * (len(vs) - 1))))
        out.append(f"{p}%={_fmt(kind, vs[i])}")
    return "; ".join(out)


def format_report(metric_names, counter_names) -> str:
    lines = []
    for name in metric_names:
        m = _m.metrics.get(name)
        if m is None:
            continue
        data = _m.metric_data(name)
        total, acc, samples = data
        lines.append(f"Metric: {name}")
        lines.append(f"  TotalSamples: {total}")
        lines.append(f"  Accumulator: {_fmt(m.kind, acc)}")
        if len(samples) >= 2:
            span = samples[-1][0] - samples[0][0]
            if span > 0:
                vsum = sum(v for _, v in samples[1:])
                lines.append(f"  ValueRate: {_fmt(m.kind, vsum / span)} / second")
                lines.append(f"  Rate: {(len(samples) - 1) / span:.6g} / second")
        if samples:
            lines.append(f"  Percentiles: {_percentiles([v for _, v in samples], m.kind)}")
    for name in counter_names:
        value = _m.counter(name)
        if value is not None:
            lines.append(f"Counter: {name}")
            lines.append(f"  Value: {value}")
    return "\n".join(lines) + ("\n" if lines else "")
