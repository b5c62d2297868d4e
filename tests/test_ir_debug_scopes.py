"""IR debugging: with XLA_IR_DEBUG or XLA_HLO_DEBUG, `_xla_tensors_report` shows the Python
frames that created each tensor (`Frames:`) and the profiler `Trace` scope of its nodes
(`scope=<name>.<n>`); without either, neither (and nothing is recorded). The variables are
read at import: each mode runs in its own process."""
import os
import subprocess
import sys
import textwrap

import pytest

_PROG = """
    import torch, torch_xla
    import torch_xla.debug.profiler as xp
    from torch_xla._engine import ir
    d = torch_xla.device()
    with xp.Trace('outer'):
        t = torch.tensor([2.0, 3.0], device=d)                  # LINE_T
        with xp.Trace('inner'):
            u = t * 4                                          # LINE_U
    with xp.Trace('outer'):
        v = u + 1
    report = torch_xla._XLAC._xla_tensors_report(0, str(d))
    print("REPORT-BEGIN"); print(report); print("REPORT-END")
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([u])
    print("HLO-MUL", [line for line in hlo.splitlines() if " multiply(" in line])
    print("RECORDED", len(ir.DEBUG_INFO))
    assert torch.equal(v.cpu(), torch.tensor([2.0, 3.0]) * 4 + 1)
"""


def _run(tmp_path, **env):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(_PROG))
    full = dict(os.environ, PJRT_DEVICE="CPU", **env)
    for k in ("XLA_IR_DEBUG", "XLA_HLO_DEBUG", "PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG"):
        if k not in env:
            full.pop(k, None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=full)
    assert out.returncode == 0, out.stdout + out.stderr
    report = out.stdout.split("REPORT-BEGIN\n", 1)[1].split("REPORT-END", 1)[0]
    recorded = int(out.stdout.split("RECORDED ", 1)[1].split()[0])
    return report, recorded, out.stdout.split("HLO-MUL ", 1)[1].split("\n", 1)[0]


def _line(needle):
    return next(i for i, line in enumerate(textwrap.dedent(_PROG).splitlines(), 1) if needle in line)


@pytest.mark.parametrize("var", ["XLA_IR_DEBUG", pytest.param("XLA_HLO_DEBUG", marks=pytest.mark.slow)])
def test_frames_and_scopes_with_debug(tmp_path, var):
    report, recorded, hlo_mul = _run(tmp_path, **{var: "1"})
    assert recorded > 0
    if var == "XLA_HLO_DEBUG":   # the scope leads the op's name scope in the HLO metadata
        assert f'op_name="jit(fn)/outer.1/inner.1/prog.py:{_line("LINE_U")}/mul"' in hlo_mul, hlo_mul
    blocks = [b for b in report.split("Tensor: id=")[1:]]
    by_nodes = {int(b.split("ir_nodes=")[1].split()[0]): b for b in blocks}
    # t alone: device data made in the first 'outer' region
    data = by_nodes[1]
    assert "Frames:\n  <module> (" in data and f"prog.py:{_line('LINE_T')})" in data
    assert "xla::device_data(), scope=outer.1, ROOT=0" in data
    # v = (t * 4) + 1: the mul in outer.1/inner.1, the add in the second outer region
    full = max(by_nodes.items())[1]
    mul = next(line for line in full.splitlines() if "aten::mul.Tensor(" in line)
    assert mul.endswith(f", scope=outer.1/inner.1, location=prog.py:{_line('LINE_U')}"), mul
    add = next(line for line in full.splitlines() if "aten::add.Tensor(" in line)
    assert ", scope=outer.2, location=prog.py:" in add and add.endswith("ROOT=0"), add


def test_nothing_without_debug(tmp_path):
    report, recorded, hlo_mul = _run(tmp_path)
    assert recorded == 0 and "outer" not in hlo_mul
    assert "Tensor: id=" in report and "ir_nodes=" in report
    assert "Frames" not in report and "scope=" not in report
