"""Errors on wait, exit and store paths keep their type and message instead of vanishing.

- the torch.distributed store on the coordination service reports a timeout, an
  unreachable service and other failures as PyTorch's stores do (DistStoreError /
  DistNetworkError), with the service's message;
- a spawned function whose result cannot be pickled (or unpickled) fails the launch with
  an error naming the type, instead of returning None;
- waiting for device buffers skips donated ones and raises a failed execution;
- a failed optimized compile of a tiered program warns with its error;
- `xla_backend.install()` is idempotent.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_xla
from torch_xla._engine import ir, launcher, pjrt, telemetry
from torch_xla._engine.executor import barrier
from torch_xla._engine.executor import compile as compiling

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from mp_scripts import error_path_workers as workers  # noqa: E402


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "WORLD_SIZE", "RANK")}
    full.update(PJRT_DEVICE="CPU", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


# ---- the store on the coordination service ------------------------------------------------

# One process with a real coordination service: XlaKVStore's answers next to PyTorch's
# HashStore for the same calls, and the errors of a timeout and of a refused connection.
_STORE = r"""
    import datetime, socket
    import torch.distributed as dist
    from jax._src.lib import _jax as xe
    from torch_xla.distributed import _xla_store
    from torch_xla.distributed._xla_process_group import ProcessGroupXla, _dumps

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    addr = f"127.0.0.1:{free_port()}"
    service = xe.get_distributed_runtime_service(addr, 1)
    client = xe.get_distributed_runtime_client(addr, 0, init_timeout=30)
    client.connect()
    _xla_store._job.kv_client = lambda: client

    def calls(store):
        out = []
        def call(name, *args):
            try:
                out.append((name, getattr(store, name)(*args)))
            except dist.DistError as e:
                out.append((name, type(e).__name__))
        store.set("a", "1")
        call("get", "a")
        call("check", ["a"])
        call("check", ["a", "missing"])
        call("add", "n", 3)
        call("add", "n", 4)
        call("compare_set", "c", "", "v")
        call("compare_set", "c", "wrong", "w")
        call("compare_set", "d", "q", "w")
        call("delete_key", "a")
        call("delete_key", "a")
        call("get", "missing")
        return out

    timeout = datetime.timedelta(seconds=0.3)
    xla = calls(_xla_store.XlaKVStore(timeout))
    ref_store = dist.HashStore()
    ref_store.set_timeout(timeout)
    ref = calls(ref_store)
    print("SAME", xla == ref, xla)

    try:
        _xla_store.XlaKVStore(timeout).get("missing")
    except dist.DistStoreError as e:
        print("TIMEOUT", type(e).__name__, str(e).splitlines()[0])

    # Through PyTorch's C++ PrefixStore (how torch.distributed calls a store).
    store = _xla_store.XlaKVStore(timeout)
    try:
        dist.PrefixStore("pg", store).get("missing")
    except dist.DistStoreError as e:
        print("PREFIX", type(e).__name__, "DEADLINE_EXCEEDED" in str(e))

    # recv: a timeout leaves the message sequence where it was.
    pg = ProcessGroupXla(dist.HashStore(), 0, 2)
    import torch
    t = torch.zeros(2)
    try:
        pg.recv([t], 1)
    except dist.DistStoreError as e:
        print("RECV", type(e).__name__, str(e).splitlines()[0])
    client.key_value_set_bytes("torch_xla/pg/p2p/1->0/0/0", _dumps(torch.tensor([5., 6.])))
    pg.recv([t], 1)
    print("RECEIVED", t.tolist(), client.key_value_dir_get_bytes("torch_xla/pg/p2p/"))

    # A client whose service is not there: connection refused, not a timeout.
    _xla_store._job.kv_client = lambda: xe.get_distributed_runtime_client(f"127.0.0.1:{free_port()}", 0)
    for call in (lambda s: s.get("k"), lambda s: s.check(["k"]), lambda s: s.set("k", "v")):
        try:
            call(_xla_store.XlaKVStore(timeout))
        except dist.DistError as e:
            print("REFUSED", type(e).__name__, "Connection refused" in str(e),
                  type(e.__cause__).__name__)
    client.shutdown()
    service.shutdown()
    print("DONE")
"""


def test_store_on_coordination_service_matches_hashstore_and_names_the_cause():
    out = _run(_STORE, XLA_COLLECTIVE_TIMEOUT_S="1")
    lines = out.stdout
    assert "DONE" in lines, out.stderr[-3000:]
    assert "SAME True" in lines, lines
    assert "TIMEOUT DistStoreError XlaKVStore.get('missing') timed out after 0.3 s (DEADLINE_EXCEEDED:" in lines
    assert "PREFIX DistStoreError True" in lines
    assert "RECV DistStoreError recv from rank 1 timed out after 1 s (DEADLINE_EXCEEDED:" in lines
    assert "RECEIVED [5.0, 6.0] []" in lines
    assert lines.count("REFUSED DistNetworkError True JaxRuntimeError") == 3, lines


def _jax_error(text: str) -> BaseException:
    return pjrt.jax_module().errors.JaxRuntimeError(text)


class _FailingClient:
    """A coordination-service client whose every call fails with `text`."""

    def __init__(self, text: str):
        self.text = text

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise _jax_error(self.text)
        return fail


@pytest.mark.parametrize("status, error, words", [
    ("DEADLINE_EXCEEDED: GetKeyValue() timed out", dist.DistStoreError, "timed out after 2 s"),
    ("UNAVAILABLE: failed to connect: Connection refused", dist.DistNetworkError, "unreachable"),
    ("INTERNAL: the service broke", dist.DistStoreError, "failed: INTERNAL: the service broke"),
])
def test_store_errors_name_their_cause(monkeypatch, status, error, words):
    import datetime
    from torch_xla.distributed import _xla_store
    monkeypatch.setattr(_xla_store._job, "kv_client", lambda: _FailingClient(status))
    store = _xla_store.XlaKVStore(datetime.timedelta(seconds=2))
    for call in (lambda: store.get("k"), lambda: store.wait(["k"]), lambda: store.check(["k"]),
                 lambda: store.add("k", 1), lambda: store.set("k", "v"), lambda: store.delete_key("k")):
        with pytest.raises(error) as ei:
            call()
        assert type(ei.value) is error
        assert status.split(":")[0] in str(ei.value)
        assert ei.value.__cause__ is not None and str(ei.value.__cause__) == status
    with pytest.raises(error, match=words):
        store.get("k")


def test_store_not_found_is_an_answer_not_an_error(monkeypatch):
    from torch_xla.distributed import _xla_store
    monkeypatch.setattr(_xla_store._job, "kv_client", lambda: _FailingClient("NOT_FOUND: Config key k not found."))
    store, ref = _xla_store.XlaKVStore(), dist.HashStore()
    assert store.check(["k"]) == ref.check(["k"]) is False
    assert store.compare_set("k", "x", "y") == ref.compare_set("k", "x", "y") == b"x"


def test_recv_anysource_raises_a_broken_service(monkeypatch):
    from torch_xla.distributed import _xla_process_group as pgm
    monkeypatch.setattr(pgm._job, "kv_client", lambda: _FailingClient("UNAVAILABLE: Connection refused"))
    pg = pgm.ProcessGroupXla(dist.HashStore(), 0, 2)
    with pytest.raises(dist.DistNetworkError, match="recv from rank 1 failed"):
        pg.recv_anysource([torch.zeros(1)])
    with pytest.raises(dist.DistNetworkError, match="send to rank 1 failed"):
        pg.send([torch.zeros(1)], 1)
    assert pg._p2p_seq == {}  # nothing was sent or received


def test_default_store_outlives_init_process_group():
    """torch.distributed keeps the C++ side of the `xla://` store only: its Python side
    must stay alive for store calls after init (new_group's barrier, user code)."""
    res = launcher.spawn(workers.default_store_job, nprocs=2, return_results=True)
    assert res == {0: [b"from 1", b"from 1"], 1: [b"from 0", b"from 1"]}


# ---- results of spawned functions --------------------------------------------------------

def _launch(fn):
    context = launcher.start_processes(fn, nprocs=2, eager_init=False)
    context.join()
    return context.results()


def test_unpicklable_result_fails_the_launch_naming_its_type():
    with pytest.raises(launcher.ProcessFailedError) as ei:
        _launch(workers.return_lock)
    assert ei.value.rank == 1
    assert "TypeError: replica 1 returned a _thread.lock, which cannot be pickled" in str(ei.value)
    assert "cannot pickle '_thread.lock' object" in str(ei.value)


def test_result_that_does_not_unpickle_in_the_parent_is_reported():
    with pytest.raises(RuntimeError, match="the result of replica 1 could not be unpickled in the parent "
                                           "process: ValueError: this result refuses to be unpickled") as ei:
        _launch(workers.return_loads_badly)
    assert isinstance(ei.value.__cause__, ValueError)


@pytest.mark.slow   # ~6 s: two processes
def test_run_multiprocess_names_the_unpicklable_result():
    # In a fresh process: run_multiprocess refuses a caller that has started the runtime.
    out = _run("""
        import sys
        sys.path.insert(0, "tests")
        from mp_scripts import error_path_workers as workers
        from torch_xla._engine import launcher
        from torch_xla._internal import pjrt
        try:
            pjrt.run_multiprocess(workers.lock_result)
        except launcher.ProcessFailedError as e:
            print("FAILED", "returned a _thread.lock (at result[1])" in str(e))
    """)
    assert "FAILED True" in out.stdout, out.stderr[-3000:]


def test_replica_leaving_through_sys_exit_0_has_no_result():
    assert _launch(workers.exit_cleanly_on_one) == {0: {"rank": 0}, 1: None}


def test_pickle_result_names_the_type():
    with pytest.raises(TypeError, match=r"replica 3 returned a builtins.function, .*\((AttributeError|PicklingError): "):
        launcher._pickle_result(lambda: 0, 3)
    with pytest.raises(TypeError, match=r"replica 0 returned a _thread.lock \(at result\[1\]\['lock'\]\)"):
        launcher._pickle_result((0, {"ok": 1, "lock": threading.Lock()}), 0)
    assert pickle.loads(launcher._pickle_result({"a": torch.ones(2)}, 0))["a"].tolist() == [1.0, 1.0]


def test_unwritable_traceback_is_said_on_stderr(tmp_path):
    missing = str(tmp_path / "gone")
    note = launcher._record_error(missing, 1, "Traceback ...")
    assert note.startswith("(could not record this traceback for the parent: [Errno 2]")
    assert launcher._record_error(str(tmp_path), 1, "Traceback ...") == ""
    assert (tmp_path / "error-1.txt").read_text() == "Traceback ..."


# ---- waiting for buffers -------------------------------------------------------------------

class _FailedBuffer:
    """A buffer whose program failed (not deleted): waiting raises the failure."""

    def block_until_ready(self):
        raise _jax_error("INTERNAL: the program failed")

    def is_deleted(self):
        return False


def _deleted_buffer():
    a = pjrt.jax_module().numpy.ones(3)
    a.delete()
    return a


def test_barrier_wait_skips_donated_buffers_and_raises_failures():
    state = lambda array: types.SimpleNamespace(node=ir.DeviceData(array, ((3,), np.dtype(np.float32))))  # noqa: E731
    barrier.wait_all([state(_deleted_buffer())])
    with pytest.raises(RuntimeError, match="INTERNAL: the program failed"):
        barrier.wait_all([state(_deleted_buffer()), state(_FailedBuffer())])


def test_wait_device_ops_skips_donated_buffers_and_raises_failures(monkeypatch):
    import torch_xla.core.xla_model as xm
    jax = pjrt.jax_module()
    monkeypatch.setattr(jax, "live_arrays", lambda: [_deleted_buffer()])
    xm.wait_device_ops()
    monkeypatch.setattr(jax, "live_arrays", lambda: [_deleted_buffer(), _FailedBuffer()])
    with pytest.raises(RuntimeError, match="INTERNAL: the program failed"):
        xm.wait_device_ops()


def test_sync_wait_still_works(dev):
    t = torch.arange(4., device=dev) * 2
    torch_xla.sync(wait=True)
    assert t.cpu().tolist() == (torch.arange(4.) * 2).tolist()


def test_memory_info_without_allocator_statistics(monkeypatch):
    class NoStats:
        def memory_stats(self):
            raise _jax_error("UNIMPLEMENTED: GetAllocatorStats is not supported")

    monkeypatch.setattr(pjrt, "default_device", lambda: NoStats())
    info = pjrt.memory_info()
    assert info["bytes_limit"] > 0 and info["kb_total"] == info["bytes_limit"] // 1024

    class Broken:
        def memory_stats(self):
            raise KeyError("a bug, not a missing statistic")

    monkeypatch.setattr(pjrt, "default_device", lambda: Broken())
    with pytest.raises(KeyError):
        pjrt.memory_info()


# ---- tiered compilation ------------------------------------------------------------------

def test_failed_optimized_compile_warns_with_its_error():
    def build():
        raise MemoryError("out of memory compiling the optimized program")

    quick = object()
    exe = compiling.Executable(quick, (), 0, upgrade=build)
    before = telemetry.counter("TieredCompileFailed") or 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            exe.settle()
    assert exe.compiled is quick and exe.upgrade is None
    assert telemetry.counter("TieredCompileFailed") == before + 1
    texts = [str(w.message) for w in caught]
    assert any("MemoryError: out of memory compiling the optimized program" in t for t in texts), texts


# ---- registration ------------------------------------------------------------------------

def test_install_is_idempotent_and_leaves_new_group_alone():
    # In a fresh process. The backend's creator takes torch.distributed's extended form, so
    # subgroups learn their ranks without a replacement of `dist.new_group`.
    out = _run("""
        import sys
        import torch.distributed as dist
        torch_new_group = dist.new_group
        import torch_xla.distributed.xla_backend as xb
        xb.install()
        xb.install()
        handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
        print("NEW_GROUP", dist.new_group is torch_new_group, True)
        print("BACKEND", dist.Backend.backend_list.count("xla"), dist.Backend.XLA,
              dist.Backend._plugins["XLA"].creator_fn is xb._create_process_group)
        print("RDZV", handlers["xla"].__module__)
        print("NAMES", all(hasattr(xb, n) for n in xb.__all__), sorted(xb.__all__))
        dist.init_process_group("xla", init_method="xla://")
        print("INIT", type(dist.group.WORLD).__name__, dist.get_world_size())
    """)
    lines = out.stdout
    assert "NEW_GROUP True True" in lines, out.stderr[-3000:]
    assert "BACKEND 1 xla True" in lines
    assert "RDZV torch_xla.distributed.xla_backend" in lines
    assert ("NAMES True ['ProcessGroupXla', 'WorkXla', 'XlaKVStore', 'install', 'make_xla_process_group']"
            in lines)
    assert "INIT ProcessGroupXla 1" in lines


def test_install_reports_a_foreign_xla_rendezvous(monkeypatch):
    import torch_xla.distributed.xla_backend as xb
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers

    def foreign(url, **kwargs):
        yield None

    monkeypatch.setitem(handlers, "xla", foreign)
    with pytest.warns(UserWarning, match="xla:// is registered by .*foreign, which is left in place"):
        xb.install()
    assert handlers["xla"] is foreign


def test_engine_rendezvous_failures_name_their_cause():
    # comm.rendezvous / p2p report the coordination service's cause, not always "timed out".
    from torch_xla._engine import job
    timeout = job.service_failure("rendezvous 'x': waiting for replica 1",
                                  RuntimeError("DEADLINE_EXCEEDED: Barrier timed out\ndetail"), 30)
    assert timeout == "rendezvous 'x': waiting for replica 1 did not complete within 30 s (DEADLINE_EXCEEDED: Barrier timed out)"
    gone = job.service_failure("recv on channel 3", RuntimeError("UNAVAILABLE: failed to connect to all addresses"))
    assert "coordination service is unreachable" in gone and "failed to connect" in gone
    other = job.service_failure("send on channel 3", RuntimeError("INTERNAL: boom"))
    assert other == "send on channel 3 failed: INTERNAL: boom"
