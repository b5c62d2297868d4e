"""The debugging chapter: PT_XLA_DEBUG_LEVEL's analyses, the debugging environment variables
and the profiler. Each variable is read at import, so most checks run a small program in a
subprocess and read what it printed or wrote; values are compared with eager CPU there."""
import glob
import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_xla
import torch_xla._XLAC as _XLAC
from torch_xla._engine import env_vars
from torch_xla._engine.lowering.table import LOWERINGS


def _run(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    full = dict(os.environ, PJRT_DEVICE="CPU", **env)
    for k in ("PT_XLA_DEBUG", "PT_XLA_DEBUG_LEVEL", "XLA_IR_DEBUG", "XLA_HLO_DEBUG"):
        if k not in env:
            full.pop(k, None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=full, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _line_of(code: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(code).splitlines(), 1) if needle in line)


_TRAINING = """
    import torch, torch_xla, torch_xla.core.xla_model as xm
    import torch_xla.debug.profiler as xp
    d = torch_xla.device()
    torch.manual_seed(0)
    w_cpu = torch.randn(4, 3)
    w = w_cpu.to(d)
    for n in (8, 8, 9):
        x_cpu = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) / 10
        y = (x_cpu.to(d) @ w).relu().sum()
        torch_xla.sync()
        assert torch.allclose(y.cpu(), (x_cpu @ w_cpu).relu().sum(), rtol=1e-5)
    z = (w * 3).sum()                                   # LINE_HOST_READ
    assert abs(z.item() - float((w_cpu * 3).sum())) < 1e-4
    xm.mark_step()
    with xp.StepTrace("train", step_num=0):
        v = w + 1
    compiled = torch_xla.compile(lambda t: t * 2, name="double")
    assert torch.equal(compiled(w).cpu(), w_cpu * 2)
"""


def test_debug_level_2_analysis_and_summary(tmp_path):
    log = tmp_path / "debug.txt"
    _run(_TRAINING, tmp_path, PT_XLA_DEBUG_LEVEL="2", PT_XLA_DEBUG_FILE=str(log))
    text = log.read_text()
    lines = text.splitlines()
    causes = [lines[i + 1].strip().split(": ", 1)[1].strip() for i, line in enumerate(lines)
              if line.endswith("Compilation Cause")]
    exec_causes = [lines[i + 1].split(": ", 1)[1].strip() for i, line in enumerate(lines)
                   if line.endswith("Execution Cause")]
    assert causes[:2] == ["user torch_xla.sync"] * 2
    assert "user code trying to access tensor value before torch_xla.sync" in causes
    # The host read names the user's line and its source.
    read = _line_of(_TRAINING, "z.item()")
    assert f"prog.py:{read}: assert abs(z.item()" in text
    assert "torch_xla.sync when exiting a profiler StepTrace region" in causes
    assert "torch_xla.compile" in causes
    assert "Graph Name: double" in text
    # The second n=8 step is a cached program: executed, not compiled.
    assert exec_causes.count("user torch_xla.sync") == 3
    assert causes.count("user torch_xla.sync") == 2   # n=8, n=9
    # The recompile names the changed op and the line that built it.
    again = [line for line in lines if "Compiled Again" in line]
    assert again
    made = _line_of(_TRAINING, "x_cpu.to(d)")
    assert any(f"shape changed (used at prog.py:{made}): input float32[8,4]  =>  input float32[9,4]" in line
               for line in lines), text
    assert "Number of Graph Inputs: " in text and "Graph Hash: " in text
    assert "Python Frame Triggered Execution" in text and "<module> (" in text
    assert "Post Compilation Analysis: Graph input size:" in text
    summary = [line for line in lines if line.startswith("pt-xla-profiler: summary")]
    assert summary and "compilation(s)" in summary[0]
    assert any("caused by reading a tensor's value" in line and f"prog.py:{read}" in line for line in lines)


def test_debug_level_1_compiles_only(tmp_path):
    out = _run(_TRAINING, tmp_path, PT_XLA_DEBUG_LEVEL="1")
    assert "Compilation Cause" in out.stderr
    assert "Execution Cause" not in out.stderr
    assert "pt-xla-profiler: summary" in out.stderr


def test_no_debug_prints_nothing(tmp_path):
    out = _run(_TRAINING, tmp_path)
    assert "Analysis" not in out.stderr + out.stdout and "pt-xla-profiler" not in out.stderr


def test_debug_files_flags_and_refusals(tmp_path):
    saved, metrics_file, dump = tmp_path / "graphs.txt", tmp_path / "metrics.txt", tmp_path / "dump"
    cache = tmp_path / "cache"
    out = _run("""
        import torch, torch_xla
        import torch_xla._engine.executor.barrier as b
        d = torch_xla.device()
        a = torch.ones(3, 3, device=d) * 5
        a = a + 1                                            # line 6
        torch_xla.sync()
        assert torch.equal(a.cpu(), torch.full((3, 3), 6.0))
        assert torch_xla.experimental.is_eager_mode() is False
        """, tmp_path, XLA_IR_DEBUG="1", XLA_SAVE_TENSORS_FILE=str(saved), XLA_METRICS_FILE=str(metrics_file),
        XLA_SYNC_WAIT="1", XLA_FLAGS=f"--xla_dump_to={dump}", XLA_PERSISTENT_CACHE_PATH=str(cache),
        XLA_DISABLE_FUNCTIONALIZATION="1")
    graphs = (tmp_path / "graphs.txt.0").read_text()   # the name with the device ordinal appended
    assert "[ScheduleSyncTensorsGraph] cause: user torch_xla.sync" in graphs
    assert "aten::add.Tensor" in graphs and "location=prog.py:6" in graphs
    assert "Metric: ExecuteTime" in metrics_file.read_text()
    assert any(f.endswith(".txt") for f in os.listdir(dump)), os.listdir(dump)
    assert os.listdir(cache)
    assert "XLA_DISABLE_FUNCTIONALIZATION is set but has no effect" not in out.stderr


def test_save_tensors_hlo_format_and_eager_debug_mode(tmp_path):
    saved = tmp_path / "graphs.hlo"
    _run("""
        import torch, torch_xla
        d = torch_xla.device()
        assert torch_xla.experimental.is_eager_mode()
        t = torch.arange(4., device=d) * 2
        assert torch.equal(t.cpu(), torch.arange(4.) * 2)
        """, tmp_path, XLA_SAVE_TENSORS_FILE=str(saved), XLA_SAVE_TENSORS_FMT="hlo", XLA_USE_EAGER_DEBUG_MODE="1")
    # Eager mode runs ops one by one: the file holds no graph of them, but the variable is read.
    dumped = tmp_path / "graphs.hlo.0"   # the name with the device ordinal appended
    assert not dumped.exists() or "HloModule" in dumped.read_text()
    _run("""
        import torch, torch_xla
        d = torch_xla.device()
        t = torch.arange(4., device=d) * 2
        torch_xla.sync()
        assert torch.equal(t.cpu(), torch.arange(4.) * 2)
        """, tmp_path, XLA_SAVE_TENSORS_FILE=str(saved), XLA_SAVE_TENSORS_FMT="hlo")
    assert "HloModule" in dumped.read_text() and "multiply" in dumped.read_text()


def test_ir_debug_and_dot_in_process():
    d = torch_xla.device()
    was = _XLAC._get_ir_debug()
    _XLAC._set_ir_debug(True)
    try:
        t = torch.ones(2, 2, device=d).exp()
    finally:
        _XLAC._set_ir_debug(was)
    text = _XLAC._get_xla_tensors_text([t])
    assert "aten::exp" in text and "location=test_debugging.py:" in text
    dot = _XLAC._get_xla_tensors_dot([t])
    assert dot.startswith("digraph G {") and "aten::exp" in dot and "->" in dot
    assert torch.allclose(t.cpu(), torch.ones(2, 2).exp())


def test_save_hlo_file_on_compile_error(tmp_path):
    path = tmp_path / "failed.txt"
    low = LOWERINGS["erfinv.default"]
    saved = low.fn

    def broken(*a, **k):
        raise ValueError("lowering broken on purpose")
    low.fn = broken
    try:
        with env_vars.overlay({"XLA_SAVE_HLO_FILE": str(path), "XLA_DUMP_HLO_GRAPH": "1"}):
            t = (torch.full((3,), 0.25, device=torch_xla.device()) * 2).erfinv()
            with pytest.raises(Exception) as err:
                torch_xla.sync()
    finally:
        low.fn = saved
        torch_xla.sync()
    assert "aten::erfinv" in path.read_text()
    assert str(path) in "\n".join(getattr(err.value, "__notes__", []))
    assert torch.allclose(t.cpu(), torch.full((3,), 0.5).erfinv())


def test_profiler_trace_holds_user_and_engine_names(tmp_path):
    logdir, remote = tmp_path / "trace", tmp_path / "remote"
    _run(f"""
        import glob, gzip, json, socket, time
        import torch, torch_xla, torch_xla.debug.profiler as xp
        d = torch_xla.device()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        ref = torch.nn.Linear(4, 2)
        ref.load_state_dict(model.state_dict())
        model = model.to(d)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(8, 4)

        @xp.trace_me("user_loss_fn")
        def loss_of(m, inp):
            return m(inp).pow(2).mean()

        xp.start_trace({str(logdir)!r})
        for step in range(2):
            with xp.StepTrace("user_train_step", step_num=step):
                with xp.Trace("user_forward"):
                    loss = loss_of(model, x.to(d))
                loss.backward()
                opt.step()
                opt.zero_grad()
            l_ref = loss_of(ref, x)
            l_ref.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            assert torch.allclose(loss.cpu(), l_ref.detach(), rtol=1e-5)
        xp.stop_trace()
        assert torch.allclose(model.weight.cpu(), ref.weight.detach(), rtol=1e-5)

        # A capture from this process's own profiler server, in the background.
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        assert xp.start_server(port) is xp.start_server(port)
        t = xp.trace_detached(f"localhost:{{port}}", {str(remote)!r}, duration_ms=1500)
        time.sleep(0.3)
        torch_xla.sync()
        with xp.Trace("user_while_served"):
            (torch.ones(3, device=d) * 7).cpu()
        t.join()
        """, tmp_path)
    pbs = glob.glob(str(logdir / "plugins" / "profile" / "*" / "*.xplane.pb"))
    traces = glob.glob(str(logdir / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert len(pbs) == 1 and len(traces) == 1
    with gzip.open(traces[0]) as fh:
        events = json.load(fh)["traceEvents"]
    names = {e.get("name") for e in events}
    for want in ("user_train_step", "user_forward", "user_loss_fn", "torch_xla::sync", "torch_xla::build_graph",
                 "torch_xla::lower", "torch_xla::compile", "torch_xla::execute", "torch_xla::transfer_from_device"):
        assert want in names, want
    remote_pbs = glob.glob(str(remote / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(remote_pbs) == 1 and b"user_while_served" in open(remote_pbs[0], "rb").read()


def test_profiler_session_errors():
    import torch_xla.debug.profiler as xp
    with pytest.raises(RuntimeError, match="No profile started"):
        xp.stop_trace()


def test_debug_env_vars_are_registered():
    for name in ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "XLA_SAVE_TENSORS_FILE",
                 "XLA_SAVE_TENSORS_FMT", "XLA_METRICS_FILE", "XLA_SAVE_HLO_FILE", "XLA_SYNC_WAIT", "XLA_FLAGS",
                 "XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_USE_SPMD", "XLA_PERSISTENT_CACHE_PATH",
                 "XLA_USE_EAGER_DEBUG_MODE", "XLA_DUMP_HLO_GRAPH", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE",
                 "TF_CPP_LOG_THREAD_ID", "XLA_DYNAMO_DEBUG"):
        assert name in env_vars.VARS, name


_DEVICE_TYPES_SET_AFTER_IMPORT = r"""
import os, torch, torch_xla
os.environ["XLA_DOWNCAST_BF16"] = "1"     # set after import, before the first float tensor
os.environ["XLA_USE_32BIT_LONG"] = "1"
x = torch.tensor([2.5, 3.5], dtype=torch.float64, device="xla")
i = torch.arange(6, device="xla")
text = torch_xla._XLAC._get_xla_tensors_text([x * 2, i + 1])
r = (i * 7 + 3).cpu()
assert r.dtype == torch.int64 and r.tolist() == (torch.arange(6) * 7 + 3).tolist(), r
assert (x * 2).cpu().tolist() == [5.0, 7.0]
os.environ["XLA_DOWNCAST_BF16"] = "0"     # fixed once the first such tensor exists
y = torch.tensor([1.0], dtype=torch.float64, device="xla")
print(text + torch_xla._XLAC._get_xla_tensors_text([y]))
"""


def test_device_dtype_variables_are_read_at_the_first_tensor(tmp_path):
    out = _run(_DEVICE_TYPES_SET_AFTER_IMPORT, tmp_path)
    lines = [ln for ln in out.stdout.splitlines() if "device_data" in ln]
    assert any("f32[2]" in ln for ln in lines), out.stdout
    assert any("s32[6]" in ln for ln in out.stdout.splitlines()), out.stdout
    assert "f32[1]{0} xla::device_data()" in out.stdout, out.stdout


def test_barrier_inside_a_trace_region_is_refused():
    """A barrier cannot cut a profiler region (the documented rule): sync / mark_step raise
    inside `Trace`, name the open scopes, and run again once the region is left; a host
    read inside it, a StepTrace's own barrier and `reset_scope=False` run."""
    import torch_xla.debug.profiler as xp
    import torch_xla.core.xla_model as xm
    d = torch_xla.device()
    x = torch.arange(4.0, device=d)
    with xp.Trace("outer"):
        y = x * 2
        with xp.Trace("inner"):
            with pytest.raises(RuntimeError, match=r"Expecting scope to be empty but it is outer\.1/inner\.1"):
                torch_xla.sync()
        with pytest.raises(RuntimeError, match=r"it is outer\.1$"):
            xm.mark_step()
        assert torch.equal(y.cpu(), torch.arange(4.0) * 2)   # a host read is not a barrier
        xm.mark_step(reset_scope=False)
    with xp.Trace("second"):
        with pytest.raises(RuntimeError, match=r"it is second\.2$"):
            torch_xla.sync()
    torch_xla.sync()
    with xp.StepTrace("step", step_num=0):
        z = x + 1
    assert torch.equal(z.cpu(), torch.arange(4.0) + 1)

    @xp.trace_me("decorated")
    def f():
        torch_xla.sync()
    with pytest.raises(RuntimeError, match=r"it is decorated\.1$"):
        f()
    torch_xla.sync()
