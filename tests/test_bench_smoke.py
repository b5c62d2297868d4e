"""The benchmark scripts of BENCHMARKS.md still run: each at its `--quick` sizes, in a
subprocess as a user would start it, and its table says what the script measures (the
xla contender's losses against eager's for the training comparison)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=300):
    env = dict(os.environ, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _rows(table: str) -> dict:
    """First cell -> the other cells, for every row of the markdown tables in `table`."""
    rows = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


def test_vs_eager_trains_mnist_with_eagers_losses():
    rows = _rows(_run("bench_vs_eager.py", "--models", "mnist", "--contenders", "xla,eager", "--rounds", "1",
                      "--quick"))
    assert float(rows["xla"][0].split()[0].replace(",", "")) > 0
    first_x, last_x = (float(v) for v in rows["xla"][4].split(" / "))
    first_e, last_e = (float(v) for v in rows["eager"][4].split(" / "))
    assert first_x == pytest.approx(first_e, rel=1e-5)
    assert last_x == pytest.approx(last_e, rel=1e-3)
    assert last_x < first_x


@pytest.mark.slow
def test_tracing_reports_every_contender():
    rows = _rows(_run("bench_tracing.py", "--quick"))
    names = [k for k in rows if k.startswith(("torch-xla-jax", "torch eager", "jax tracer"))]
    assert len(names) == 3, rows
    assert all(float(rows[n][0]) > 0 for n in names)


def test_conv_formulations_report_each_variant():
    variant = '{"eigen": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE,' \
              'LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}}'
    # the script exits non-zero when a variant's outputs differ from XLA's default
    out = _run("bench_conv.py", "--quick", "--rounds", "1", "--xla-variants", variant)
    rows = _rows(out)
    head = rows.pop("convolution")
    assert head[:3] == ["XLA fwd ms", "XLA eigen fwd ms", "im2col fwd ms"]
    assert len(rows) == 3 and all(len(v) == 9 and all(float(c) > 0 for c in v) for v in rows.values()), rows
