"""Metrics and counters at their events, ready callbacks, deprecation helpers, runtime
queries and the multi-process helpers of `torch_xla._internal.pjrt`."""
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.debug.metrics_compare_utils as mcu
import torch_xla.runtime as xr
from torch_xla import _XLAC
from torch_xla._internal import pjrt
from torch_xla.experimental import callback
from torch_xla.experimental.deprecation import deprecated, mark_deprecated
from torch_xla.utils.utils import get_free_tcp_ports


def test_counters_and_metrics_appear_at_their_events(dev):
    # Pending tensors an earlier test left alive (an exception's traceback holds them)
    # would join this test's first graph: they are run first.
    torch_xla.sync()
    met.clear_all()
    a = torch.arange(6.0).reshape(2, 3)
    x = a.to(dev)
    assert {"TensorToData", "OutboundData", "TransferToDeviceTime"} <= set(met.metric_names())
    assert met.counter_value("CreateXlaTensor") == 1
    assert met.counter_value("MarkStep") is None
    y = x * 3.5 + 1.25
    assert met.counter_value("xla::mul") == 1 and met.counter_value("xla::add") == 1
    assert "CompileTime" not in met.metric_names()       # nothing ran yet
    torch_xla.sync()
    assert met.counter_value("MarkStep") == 1
    assert met.counter_value("UncachedCompile") == 1 and met.counter_value("CreateCompileHandles") == 1
    for name in ("CompileTime", "ExecuteTime", "TensorsGraphSize", "DeviceLockWait", "UnwrapXlaData",
                 "WrapXlaData", "InputOutputAliasCount"):
        assert name in met.metric_names(), name
    torch.testing.assert_close(y.cpu(), a * 3.5 + 1.25)
    assert {"TransferFromDeviceTime", "InboundData"} <= set(met.metric_names())
    z = x * 3.5 + 1.25            # the same graph again: served from the cache
    torch_xla.sync()
    assert met.counter_value("CachedCompile") == 1 and met.counter_value("UncachedCompile") == 1
    torch.testing.assert_close(z.cpu(), a * 3.5 + 1.25)
    report = met.metrics_report()
    assert "Counter: xla::mul\n  Value: 2\n" in report and "Metric: CompileTime" in report


def test_scalars_are_sent_to_the_device_once(dev):
    from torch_xla._engine.executor import graph
    graph._SCALARS.clear()   # other tests may have sent the same scalar already
    met.clear_all()
    t1, t2, t3 = (torch.randn(1, 3) for _ in range(3))
    x1, x2, x3 = (t.to(dev) for t in (t1, t2, t3))
    for _ in range(3):
        x1.addcdiv_(x2, x3, value=0.1)
        t1.addcdiv_(t2, t3, value=0.1)
        torch_xla.sync()
    assert met.metric_data("TransferToDeviceTime")[0] == 4     # three tensors, one scalar
    assert met.counter_value("DeviceDataCacheMiss") == 1
    torch.testing.assert_close(x1.cpu(), t1)
    # equal values of another sign or dtype are other entries: -0.0 stays -0.0
    for v in (0.0, -0.0):
        z = torch.ones(2, dtype=torch.float64, device=dev) * v
        assert (1 / z.cpu()).tolist() == (1 / (torch.ones(2, dtype=torch.float64) * v)).tolist()
    assert len(graph._SCALARS) <= graph.SCALAR_CACHE_SIZE


def test_execute_time_lasts_until_the_run_ends(dev):
    import time
    a = torch.randn(1500, 1500, device=dev)
    torch_xla.sync()
    met.clear_all()
    t0 = time.perf_counter_ns()
    m = (a @ a @ a @ a).mean()
    torch_xla.sync()
    m.cpu()
    wall = time.perf_counter_ns() - t0
    n, total, _ = met.metric_data("ExecuteTime")
    assert n == 1 and 0 < total <= wall
    before = met.metric_data("CompileTime")[1]
    assert total > 0.3 * (wall - before)      # the run itself, not just its dispatch


def test_lazy_tracing_times_transfers_and_first_calls(dev):
    met.clear_all()
    t = torch.tensor(156, device=dev)
    t2 = t + 100
    total, acc, samples = met.metric_data("LazyTracing")
    assert total >= 2 and acc > 0 and len(samples) == total
    assert t2.item() == 256


def test_clear_and_increment_counters(dev):
    x = torch.ones(3, device=dev)
    x += 2
    assert met.counter_value("xla::add") is not None
    met.clear_counters()
    assert met.counter_names() == [] and met.counter_value("xla::add") is None
    assert "xla::add" not in met.metrics_report()
    _XLAC._xla_increment_counter("CreateXlaTensor", 3)
    _XLAC._xla_increment_counter("SomeNewCounter", 2)
    assert met.counter_value("CreateXlaTensor") == 3 and met.counter_value("SomeNewCounter") == 2
    met.clear_metrics()
    assert met.metric_names() == [] and met.metric_data("LazyTracing") is None
    torch.testing.assert_close(x.cpu(), torch.full((3,), 3.0))


def test_short_report_and_fallback_ops(dev):
    met.clear_all()
    x = torch.tensor([1.0, -2.0, 3.0], device=dev)
    y = x * 2
    torch_xla.sync()
    assert y[1].item() == -4.0
    assert met.executed_fallback_ops() == ["aten::_local_scalar_dense"]
    short = met.short_metrics_report()
    for name in ("CompileTime", "ExecuteTime", "MarkStep", "aten::_local_scalar_dense"):
        assert name in short, name
    assert "TensorToData" not in short
    custom = met.short_metrics_report(counter_names=["CreateXlaTensor"], metric_names=["InboundData"])
    assert "CreateXlaTensor" in custom and "InboundData" in custom and "CompileTime" not in custom
    assert "aten::_local_scalar_dense" in custom      # fallbacks are always listed


def test_eager_mode_metrics(dev):
    a = torch.randn(4)
    with torch_xla.experimental.eager_mode_context(True):
        met.clear_all()
        x = a.to(dev)
        y = x * 1.5
        assert "EagerOpExecuteTime" in met.metric_names()
        torch_xla.sync()
        assert "ExecuteTime" not in met.metric_names()
    assert not torch_xla.experimental.is_eager_mode()
    torch.testing.assert_close(y.cpu(), a * 1.5)


def test_metrics_compare_utils_on_a_real_report(dev):
    met.clear_all()
    x = torch.randn(3, 3, device=dev)
    torch_xla.sync()
    x.cpu()
    report = met.metrics_report()
    points = mcu.get_data_points_from_metrics_reports([report, report])
    assert points["MarkStep__Value"] == [1, 1]
    assert points["CompileTime__Accumulator_sec"][0] > 0
    assert "InboundData__Accumulator_mb" in points and "CompileTime__Percentile_99_sec" in points
    assert mcu.compare_metrics(points, report, config={"base_expression": "v == v_mean"}) == ""
    more = report + "Counter: aten::nonzero\n  Value: 3\nCounter: MarkStep\n  Value: 7\n"
    diff = mcu.compare_metrics(points, more, config={"base_expression": "v == v_mean"})
    assert "Found new aten counter: aten::nonzero__Value: 3\n" in diff
    assert diff.count("MarkStep__Value failed its expression check") == 1


def test_metrics_compare_utils_units():
    report = ("Metric: T\n  TotalSamples: 2\n  Accumulator: 01m29s615ms\n"
              "  Percentiles: 1%=05m003ms; 50%=1.5us; 99%=02h\n"
              "Metric: D\n  TotalSamples: 1\n  Accumulator: 1.5GB\n  Percentiles: 1%=393.00KB; 99%=10B\n"
              "Counter: C\n  Value: 4\n")
    p = mcu.parse_metrics_report(report)
    assert p["T__Accumulator_sec"] == pytest.approx(89.615)
    assert p["T__Percentile_1_sec"] == pytest.approx(300.003)
    assert p["T__Percentile_50_sec"] == pytest.approx(1.5e-6)
    assert p["T__Percentile_99_sec"] == pytest.approx(7200.0)
    assert p["D__Accumulator_mb"] == pytest.approx(1500.0) and p["D__Percentile_1_mb"] == pytest.approx(0.393)
    assert p["C__Value"] == 4 and p["T__TotalSamples"] == 2.0


def _compiled_matmul(a, b):
    return a @ b


def test_on_ready_callback_after_compiled_function(dev):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    c = torch_xla.compile(_compiled_matmul)(a.to(dev), b.to(dev))
    seen = {}
    done = threading.Event()

    def cb(t):
        seen["tensor"] = t
        seen["info"] = _XLAC._get_xla_tensor_debug_info(t)
        done.set()

    callback.on_ready_callback(c, cb)
    assert done.wait(30)
    assert seen["tensor"] is c and "XLAData:" in seen["info"] and "Data Handle: None" not in seen["info"]
    torch.testing.assert_close(c.cpu(), a @ b)


def test_on_ready_event_waits_for_a_pending_value(dev):
    a = torch.randn(8)
    x = a.to(dev).sin()                     # pending: no barrier yet
    event = callback.on_ready_event(x)
    assert not event.wait(0.2)              # nothing computes it until a barrier
    torch_xla.sync()
    assert event.wait(30)
    torch.testing.assert_close(x.cpu(), a.sin())
    with pytest.raises(RuntimeError, match="xla tensor"):
        callback.on_ready_event(a)


def test_disallowed_execution_raises(dev):
    x = torch.ones(2, device=dev) * 3
    _XLAC._set_allow_execution(False)
    try:
        with pytest.raises(RuntimeError, match="Unexpected execution happens inside the compiled function"):
            x.cpu()
    finally:
        _XLAC._set_allow_execution(True)
    torch.testing.assert_close(x.cpu(), torch.full((2,), 3.0))


def _new_api(x):
    return x + 1


def test_deprecated_alias_warns_once(caplog):
    import sys
    module = sys.modules[__name__]
    old = deprecated(module, _new_api, "old_api", extra_msg="Removed in 3.0.")
    with caplog.at_level(logging.WARNING):
        assert old(1) == 2 and old(2) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"{__name__}.old_api is deprecated" in warnings[0] and "_new_api" in warnings[0]
    assert "Removed in 3.0." in warnings[0]

    @mark_deprecated(_new_api)
    def older(x):
        return x - 1   # replaced: the new function runs

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert older(5) == 6
    assert "older is deprecated" in caplog.records[0].getMessage()


def test_set_device_type_and_device_type(monkeypatch, dev):
    assert xr.device_type() == "CPU"
    xr.set_device_type("CPU")              # the type in use: accepted
    with pytest.raises(RuntimeError, match="already initialized"):
        xr.set_device_type("TPU")
    assert xr.device_type() == "CPU"
    monkeypatch.delenv("PJRT_DEVICE")
    assert xr.device_type() == "CPU"       # unset: the platform the runtime picked
    monkeypatch.setenv("PJRT_SELECT_DEFAULT_DEVICE", "0")
    assert xr.device_type() is None
    monkeypatch.setenv("PJRT_DEVICE", "tpu_legacy")
    assert xr.device_type() == "TPU"
    monkeypatch.setattr(_XLAC, "_xla_runtime_is_initialized", lambda: False)
    xr.set_device_type("CUDA")
    import os
    assert os.environ["PJRT_DEVICE"] == "CUDA"


def test_runtime_queries(dev):
    assert _XLAC._xla_runtime_is_initialized()
    assert _XLAC._xla_get_all_devices() == [f"CPU:{i}" for i in range(xr.global_device_count())]
    assert xr.host_index() == 0
    with pytest.raises(IndexError):
        torch_xla.device(10)


def test_free_tcp_ports():
    ports = get_free_tcp_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_merge_replica_results():
    assert pjrt._merge_replica_results([(1, "b"), (0, "a")]) == {0: "a", 1: "b"}
    with pytest.raises(AssertionError, match="2 results for replica 1"):
        pjrt._merge_replica_results([(1, "b"), (1, "c")])
    with pytest.raises(ValueError, match="nprocs"):
        pjrt.spawn(print, nprocs=3)


def test_run_multiprocess_raises_the_first_replica_exception_it_finds(tmp_path):
    # When the launcher blames a replica that left no exception (one that aborted after a
    # peer raised), the exception a replica did raise is the one re-raised.
    import os
    import pickle
    assert pjrt._first_child_exception(str(tmp_path)) is None
    for rank, err in ((1, TypeError("first")), (0, ValueError("second"))):
        path = tmp_path / f"{rank}.pkl"
        path.write_bytes(pickle.dumps(err))
        os.utime(path, ns=(10**18 + (0 if rank == 1 else 10**9),) * 2)
    got = pjrt._first_child_exception(str(tmp_path))
    assert type(got) is TypeError and str(got) == "first"


def test_run_multiprocess_needs_a_fresh_process(dev):
    with pytest.raises(RuntimeError, match="already initialized"):
        pjrt.run_multiprocess(xr.global_ordinal)


def test_async_closure_error_raises_at_next_barrier(dev):
    import torch_xla.core.xla_model as xm
    ran = []

    def failing():
        ran.append("failing")
        raise ValueError("closure failed")

    xm.add_step_closure(failing, run_async=True)
    torch_xla.sync()
    xm.add_step_closure(lambda: ran.append("dropped"), run_async=True)
    with pytest.raises(RuntimeError, match="asynchronous step closure failed") as info:
        torch_xla.sync()
    assert isinstance(info.value.__cause__, ValueError)
    xm.add_step_closure(lambda: ran.append("next"), run_async=True)
    torch_xla.sync()
    torch_xla.sync()
    assert ran == ["failing", "next"]


def test_an_unknown_or_missing_backend_fails_every_use_with_the_first_error():
    """PJRT_DEVICE naming no backend raises at the first device use, naming the variable and
    the backends; the error is kept: setting PJRT_DEVICE=CPU afterwards does not start a
    runtime behind the user's back."""
    code = textwrap.dedent("""
        import os, torch, torch_xla
        import torch_xla._XLAC as X
        os.environ["PJRT_DEVICE"] = "DUMMY_DEVICE"
        msgs = []
        for device in ("DUMMY_DEVICE", "CPU"):
            os.environ["PJRT_DEVICE"] = device
            try:
                X._init_computation_client()
            except RuntimeError as e:
                msgs.append(str(e))
        try:
            t = torch.ones(2, device="xla") + 1
            t.cpu()
        except RuntimeError as e:
            msgs.append(str(e))
        print(len(msgs), len(set(msgs)))
        print(msgs[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "3 1"
    assert "No PjRtPlugin registered for: DUMMY_DEVICE" in lines[1] and "PJRT_DEVICE" in lines[1]
    assert "CPU" in lines[1] and "TPU" in lines[1]
