"""Recompilations explained (torch_xla.debug.recompilation): one test per cause, each
doing what the cause names and checking the classification and suggestion reported,
with the device's values compared to eager CPU."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla.debug import recompilation


@pytest.fixture(autouse=True)
def explained():
    was = recompilation.enabled()
    recompilation.enable()
    recompilation.reset()
    torch_xla.sync()
    yield
    recompilation.reset()
    if not was:
        recompilation.disable()


def _last(cause=None):
    got = recompilation.explanations()
    assert got, "no compile was explained"
    if cause is not None:
        got = [e for e in got if e["cause"] == cause]
        assert got, recompilation.explanations()
    return got[-1]


def _check(entry, cause, *words):
    assert entry["cause"] == cause, entry
    assert entry["label"] == recompilation.CAUSES[cause][0]
    assert entry["suggestion"] == recompilation.CAUSES[cause][1]
    for w in words:
        assert w in entry["suggestion"] or w in entry["detail"], (w, entry)


def test_input_shape_drift():
    d = torch_xla.device()
    src = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    for n in (4, 5):
        y = (src[:n].to(d) * 2).sum()
        torch_xla.sync()
        assert torch.allclose(y.cpu(), (src[:n] * 2).sum())
    e = _last()
    _check(e, "shape", "buckets", "_xla_mark_dynamic", "float32[4,4]", "float32[5,4]")
    assert recompilation.counts() == {"shape": 1}


def test_dtype_change():
    d = torch_xla.device()
    for dt in (torch.float32, torch.float64):
        src = torch.arange(6, dtype=dt)
        y = (src.to(d) * 3).sum()
        torch_xla.sync()
        assert y.dtype == dt and torch.allclose(y.cpu(), (src * 3).sum())
    _check(_last(), "dtype", "cast", "float32[6]", "float64[6]")


def test_data_dependent_op():
    d = torch_xla.device()
    src = torch.arange(12, dtype=torch.float32)
    x = src.to(d)
    for thr in (3.0, 7.0):
        z = x[x > thr] * 3          # boolean-mask indexing: its size is read on the host
        w = z.sum()
        torch_xla.sync()
        assert torch.allclose(w.cpu(), (src[src > thr] * 3).sum())
    causes = [e["cause"] for e in recompilation.explanations()]
    assert causes and set(causes) == {"data_dependent"}, recompilation.explanations()
    _check(_last(), "data_dependent", "XLA_EXPERIMENTAL", "`index`")


def test_host_read_cuts_the_graph():
    d = torch_xla.device()
    src = torch.arange(6, dtype=torch.float32)
    x = src.to(d)
    for i in range(2):
        z = (x * 3).sum()
        if i:
            assert z.item() == float((src * 3).sum())     # a host read in the middle of the step
        w = z + 1
        torch_xla.sync()
        assert w.item() == float((src * 3).sum() + 1)
    causes = [e["cause"] for e in recompilation.explanations()]
    assert causes and set(causes) == {"host_read"}, recompilation.explanations()
    _check(_last(), "host_read", ".item()", "out of the loop")


def test_python_value_baked_in():
    d = torch_xla.device()
    src = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    x = src.to(d)
    for n in (2, 3):
        y = x[:, :n].sum()          # the slice's end is a Python int compiled into the graph
        torch_xla.sync()
        assert torch.allclose(y.cpu(), src[:, :n].sum())
    _check(_last(), "python_value", "device tensor", "slice")


def test_random_state_use_changed():
    d = torch_xla.device()
    x = torch.ones(4, 4, device=d)
    for i in range(2):
        y = x + 1
        if i:
            y = torch.nn.functional.dropout(y, 0.5)   # a random op on one step only
        torch_xla.sync()
        kept = y.cpu()
        assert bool(((kept == 0) | (kept == 2 * (1 + i))).all()) if i else torch.equal(kept, torch.full((4, 4), 2.0))
    _check(_last(), "rng", "same random ops", "dropout")


def test_code_path_changed():
    d = torch_xla.device()
    src = torch.arange(4, dtype=torch.float32)
    x = src.to(d)
    for i in range(2):
        y = x.sin() if i else x.cos()
        torch_xla.sync()
        assert torch.allclose(y.cpu(), src.sin() if i else src.cos())
    _check(_last(), "code_path", "torch.where", "aten::cos", "aten::sin")


def test_cached_runs_are_not_explained_and_report():
    d = torch_xla.device()
    src = torch.arange(8, dtype=torch.float32)
    for n in (4, 5, 4, 5, 4):
        y = (src[:n].to(d) + 1).sum()
        torch_xla.sync()
        assert torch.allclose(y.cpu(), (src[:n] + 1).sum())
    assert recompilation.counts() == {"shape": 1}    # the later steps ran cached programs
    text = met.recompilation_report()
    assert text == recompilation.report()
    assert "1 x input shape drift [shape]" in text and recompilation.CAUSES["shape"][1] in text


def test_exit_summary_with_debug_level(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import torch, torch_xla
        d = torch_xla.device()
        for n in (3, 4):
            y = (torch.ones(n).to(d) * 2).sum()
            torch_xla.sync()
            assert y.item() == 2.0 * n
    """))
    env = dict(os.environ, PJRT_DEVICE="CPU", PT_XLA_DEBUG_LEVEL="1")
    env.pop("PT_XLA_DEBUG_FILE", None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Recompilation Cause: input shape drift (shape)" in out.stderr
    summary = [line for line in out.stderr.splitlines() if line.startswith("pt-xla-profiler: ")]
    assert "pt-xla-profiler: Recompilations: 1 explained" in summary, summary
    assert any("1 x input shape drift [shape] (last at prog.py:6" in line for line in summary), summary
