"""Parsing metrics reports into numbers, and comparing a report with earlier ones.

A report's values become data points named `<metric>__<field>[_<unit>]`: durations in
seconds (`_sec`), sizes in megabytes (`_mb`, decimal), plain numbers without a unit,
and counters as `<counter>__Value`.
"""
from __future__ import annotations

import collections
import re
import statistics
from typing import Dict, List, Optional, Tuple

_TIME_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
_SIZE_UNITS = {"PB": 1e9, "TB": 1e6, "GB": 1e3, "MB": 1.0, "KB": 1e-3, "B": 1e-6}
_TIME_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|d|h|m|s)")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)(PB|TB|GB|MB|KB|B)", re.IGNORECASE)
_FIELD = re.compile(r"\s*(\w+):\s*(.*)$")
# A server-side report gives 25% where a client report gives 20%: both are keyed as 20.
_PERCENTILE_KEY = {"25": "20"}


def _to_number(text: str) -> Tuple[float, str]:
    """(value, unit) of one report value: a plain number, a duration such as
    `01m29s615ms` (seconds) or a size such as `1.54MB` (megabytes)."""
    text = text.strip()
    try:
        return float(text), ""
    except ValueError:
        pass
    parts = _TIME_PART.findall(text)
    if parts and "".join(v + u for v, u in parts) == text:
        return sum(float(v) * _TIME_UNITS[u] for v, u in parts), "sec"
    parts = _SIZE.findall(text)
    if parts and "".join(v + u for v, u in parts) == text:
        return sum(float(v) * _SIZE_UNITS[u.upper()] for v, u in parts), "mb"
    raise ValueError(f"Unknown metric_str format: {text}")


def _key(name: str, field: str, unit: str) -> str:
    return f"{name}__{field}" + (f"_{unit}" if unit else "")


def parse_metrics_report(report: str, dehumanize: bool = True) -> Dict[str, object]:
    """The data points of one report (`metrics_report()` text): `{key: value}`, or
    `{key: (value, original text)}` with `dehumanize=False`."""
    points: Dict[str, object] = {}

    def put(key, value, text):
        points[key] = value if dehumanize else (value, text)

    lines = report.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if line.startswith("Metric:"):
            name = line.split(":", 1)[1].strip()
            fields = {}
            while i < len(lines) and not lines[i].strip().startswith(("Metric:", "Counter:")):
                m = _FIELD.match(lines[i])
                i += 1
                if m:
                    fields[m.group(1)] = m.group(2).strip()
            if "TotalSamples" not in fields or "Accumulator" not in fields or "Percentiles" not in fields:
                continue
            put(_key(name, "TotalSamples", ""), float(fields["TotalSamples"]), fields["TotalSamples"])
            value, unit = _to_number(fields["Accumulator"])
            put(_key(name, "Accumulator", unit), value, fields["Accumulator"])
            for item in fields["Percentiles"].split(";"):
                p, _, text = item.strip().partition("%=")
                if not text:
                    continue
                value, unit = _to_number(text)
                put(_key(name, f"Percentile_{_PERCENTILE_KEY.get(p, p)}", unit), value, text)
        elif line.startswith("Counter:"):
            name = line.split(":", 1)[1].strip()
            if i < len(lines):
                m = _FIELD.match(lines[i])
                if m and m.group(1) == "Value":
                    i += 1
                    points[f"{name}__Value"] = int(m.group(2))
    return points


def get_data_points_from_metrics_reports(metrics_reports: List[str]) -> Dict[str, List[Optional[float]]]:
    """`{key: [value in report 0, value in report 1, ...]}` (None where a report lacks it)."""
    n = len(metrics_reports)
    points: Dict[str, List[Optional[float]]] = collections.defaultdict(lambda: [None] * n)
    for i, report in enumerate(metrics_reports):
        for key, value in parse_metrics_report(report).items():
            points[key][i] = value
    return points


def compare_metrics(data_points: Dict[str, List[Optional[float]]], metrics_report: str,
                    config: Optional[dict] = None) -> str:
    """One line per value of `metrics_report` that fails its check against the mean and
    (population) standard deviation of `data_points`, and per CPU-fallback counter
    (`aten::...`) that `data_points` never saw. The check is the Python expression
    `config['<key>_expression']`, else `config['base_expression']`, of `v`, `v_mean` and
    `v_stddev`; '' when everything passes."""
    if config is None:
        config = {"base_expression": "v <= v_mean + (v_stddev * 2.0)"}
    stats = {}
    for key, values in data_points.items():
        present = [v for v in values if v is not None]
        if present:
            stats[key] = (statistics.fmean(present), statistics.pstdev(present))
    out = []
    for key, v in sorted(parse_metrics_report(metrics_report).items()):
        if key not in stats:
            if key.startswith("aten::"):
                out.append(f"Found new aten counter: {key}: {v}\n")
            continue
        mean, stddev = stats[key]
        expression = config.get(f"{key}_expression") or config["base_expression"]
        if not eval(expression, {"__builtins__": {}}, {"v": v, "v_mean": mean, "v_stddev": stddev}):
            out.append(f"{key} failed its expression check. Expression: {expression}.  "
                       f"Mean: {mean}.  Stddev: {stddev}.  Actual Value: {v}\n")
    return "".join(out)
