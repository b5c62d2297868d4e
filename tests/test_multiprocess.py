"""Multi-process jobs: xmp.spawn / torch_xla.launch, collectives, torch.distributed, failures.

Every device result is compared with the value computed on the CPU from all replicas'
inputs (tests/mp_scripts/workers.py: a replica's inputs depend only on its rank).
The fast tests start 2 processes; the 4-process, slow-replica and torchrun tests are
marked slow.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from torch_xla._engine import job, launcher, pjrt, tensor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import workers  # noqa: E402

SCRIPTS = os.path.join(HERE, "mp_scripts")
REPO = os.path.dirname(HERE)


def _spawn(fn, args=(), nprocs=2):
    return launcher.spawn(fn, args=args, nprocs=nprocs, return_results=True)


def _inputs(n, shape=(2, 3)):
    return [workers.rank_input(r, shape) for r in range(n)]


def _close(a, b, **kw):
    torch.testing.assert_close(a, b, **kw)


def _pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
            if state != "Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def _child_pids(ppid):
    """Live descendants of `ppid` (from ps)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True).stdout
    kids = {}
    for line in out.splitlines():
        pid, pp, stat, args = (line.split(None, 3) + [""])[:4]
        if stat.startswith("Z") or args.startswith("ps ") or "resource_tracker" in args:
            continue
        kids.setdefault(int(pp), []).append((int(pid), args))
    res, todo = [], [ppid]
    while todo:
        for k, args in kids.get(todo.pop(), []):
            res.append((k, args))
            todo.append(k)
    return res


# ---- collectives --------------------------------------------------------------------------

def _check_collectives(res, n):
    xs = _inputs(n)
    stack = torch.stack(xs)
    ints = [torch.tensor([r + 1, 3 * r + 2, 7], dtype=torch.int32) for r in range(n)]
    bools = [torch.tensor([r == 0, True, False]) for r in range(n)]
    bigs = _inputs(n, (2 * n, 3))
    assert sorted(res) == list(range(n))
    for r in range(n):
        o = res[r]
        assert o["rank"] == r and o["world"] == n and o["index"] == r and o["local_ordinal"] == r
        _close(o["all_reduce_sum"], stack.sum(0))
        _close(o["all_reduce_mul"], stack.prod(0))
        _close(o["all_reduce_min"], stack.min(0).values)
        _close(o["all_reduce_max"], stack.max(0).values)
        and_i, or_i = ints[0].clone(), ints[0].clone()
        for t in ints[1:]:
            and_i &= t
            or_i |= t
        assert torch.equal(o["all_reduce_and_int"], and_i)
        assert torch.equal(o["all_reduce_or_int"], or_i)
        assert torch.equal(o["all_reduce_and_bool"], torch.stack(bools).all(0))
        assert torch.equal(o["all_reduce_or_bool"], torch.stack(bools).any(0))
        _close(o["all_reduce_scale"], stack.sum(0) * 0.5)
        if n % 2 == 0:
            g = (r // 2) * 2
            _close(o["all_reduce_groups"], xs[g] + xs[g + 1])
            _close(o["all_gather_groups"], torch.cat([xs[g], xs[g + 1]], 0))
        assert o["all_reduce_list_same"] is True
        _close(o["all_reduce_list"][0], stack.sum(0))
        assert torch.equal(o["all_reduce_list"][1], torch.stack(ints).sum(0).to(torch.int32))
        _close(o["all_gather_0"], torch.cat(xs, 0))
        _close(o["all_gather_1"], torch.cat(xs, 1))
        _close(o["all_gather_output"], torch.cat(xs, 0))
        total = torch.stack(bigs).sum(0)
        _close(o["reduce_scatter"], total[2 * r:2 * r + 2])
        _close(o["reduce_scatter_scaled"], total[2 * r:2 * r + 2] / n)
        _close(o["all_to_all"], torch.cat([b[2 * r:2 * r + 2] for b in bigs], 0))
        _close(o["collective_permute"], xs[(r - 1) % n])
        assert o["rendezvous"] == [f"payload-{i}".encode() for i in range(n)]
        assert o["mesh_reduce"] == sum(range(1, n + 1))
        _close(o["mesh_reduce_tensor"], torch.tensor([float(sum(range(n)))]))


def test_collectives_and_dist_backend_2_processes():
    res = _spawn(workers.collectives_job, args=(True,))
    _check_collectives(res, 2)
    _check_dist({r: res[r]["dist"] for r in res}, 2)


@pytest.mark.slow
def test_collectives_4_processes():
    res = _spawn(workers.collectives_job, args=(True,), nprocs=4)
    _check_collectives(res, 4)
    _check_dist({r: res[r]["dist"] for r in res}, 4)


def test_broadcast_master_param():
    res = _spawn(workers.broadcast_master_param_job, args=(60.0,))
    torch.manual_seed(100)
    m0 = torch.nn.Linear(3, 2)
    for r in range(2):
        for p, q in zip(res[r], m0.parameters()):
            _close(p, q.detach())


# ---- torch.distributed backend ------------------------------------------------------------

def _check_dist(res, n):
    xs = _inputs(n)
    stack = torch.stack(xs)
    bigs = _inputs(n, (2 * n, 3))
    for r in range(n):
        o = res[r]
        assert o["rank"] == r and o["world"] == n and o["backend"] == "xla"
        _close(o["all_reduce"], stack.sum(0))
        _close(o["all_reduce_max"], stack.max(0).values)
        _close(o["all_reduce_avg"], stack.mean(0))
        for i in range(n):
            _close(o["all_gather"][i], xs[i])
        _close(o["all_gather_into_tensor"], torch.cat(xs, 0))
        total = torch.stack(bigs).sum(0)
        _close(o["reduce_scatter_tensor"], total[2 * r:2 * r + 2])
        _close(o["reduce_scatter"], total[2 * r:2 * r + 2])
        _close(o["broadcast"], xs[n - 1])
        _close(o["all_to_all_single"], torch.cat([b[2 * r:2 * r + 2] for b in bigs], 0))
        if r == 1:
            _close(o["recv"], xs[0] * 10)
        assert o["all_gather_object"] == [{"rank": i, "s": "x" * (i + 1)} for i in range(n)]
        assert o["broadcast_object_list"] == [f"from-{n - 1}", n - 1]
        assert o["async_completed"] is True


@pytest.mark.slow
def test_dist_env_init_method_explicit_rank():
    os.environ["TEST_DIST_PORT"] = str(launcher.free_port())
    try:
        _check_dist(_spawn(workers.dist_job, args=("env",)), 2)
    finally:
        os.environ.pop("TEST_DIST_PORT", None)


# ---- training ---------------------------------------------------------------------------

@pytest.mark.slow
def test_training_matches_single_process():
    """xm.optimizer_step and DDP, 2 processes x 8 samples == 1 process x 16 samples (CPU)."""
    steps, batch = 4, 16
    res = _spawn(workers.train_both_job, args=(steps, batch))
    ref_params, ref_losses = workers.reference_training(steps, batch)
    for mode in ("optimizer_step", "ddp"):
        for r in range(2):
            for p, q in zip(res[r][mode]["params"], ref_params):
                _close(p, q, rtol=1e-5, atol=1e-5)
            assert res[r][mode]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for p, q in zip(res[0][mode]["params"], res[1][mode]["params"]):
            assert torch.equal(p, q), f"{mode}: replicas diverged"


# ---- device numbering -------------------------------------------------------------------

# about 16 s (4 processes); the 2-process tests cover the numbering in the main suite
@pytest.mark.slow
def test_device_numbering_4_processes(tmp_path):
    """Process i of a CPU job computes on xla:i, as in PyTorch/XLA (its
    test_runtime_multi_cpu: one process with a thread per device there): its device, its
    tensors, their gradients and the device seen inside a backward are xla:i; another
    process's index is a RuntimeError naming xla:i; saving, loading, the loader and a
    training step work as on the CPU."""
    n, steps, batch = 4, 2, 16
    res = _spawn(workers.device_numbering_job, args=(str(tmp_path), steps, batch), nprocs=n)
    ref_params, ref_losses = workers.reference_training(steps, batch)
    a = torch.arange(6.0).reshape(2, 3)
    assert sorted(res) == list(range(n))
    for r in range(n):
        o, d = res[r], f"xla:{r}"
        b = workers.rank_input(r)
        assert o["rank"] == r and o["index"] == r
        assert o["device"] == o["xla_device"] == o["device_0"] == o["default"] == d
        assert o["devices"] == o["supported"] == [d]
        assert o["count"] == o["addressable"] == 1 and o["current"] == r
        assert o["real"] == [f"CPU:{r}"]
        assert o["tensor_devices"] == {k: d for k in o["tensor_devices"]}
        assert o["storages"] == 4, o["storages"]
        expect = {"factory": a, "to": b, "op": a * b + 1, "view": b[1], "reduction": b.sum(),
                  "matmul": a @ b.T, "to_index": b, "like": torch.ones_like(b)}
        for k, v in expect.items():
            _close(o["values"][k], v)
        # d/dw of sum(sin(probe(w)) * w), probe(w) = 2w whose backward triples instead of doubles
        _close(o["grad"], (b * 2).sin() + 3 * b * (b * 2).cos())
        assert o["grad_device"] == d
        assert o["backward"] == {"forward_ordinal": r, "backward_ordinal": r, "backward_device": d,
                                 "grad_output_device": d}
        q = 1 if r != 1 else 2
        assert o["other"] == f"xla:{q}"
        for k in ("factory", "to", "tensor"):
            kind, msg = o["errors"][k]
            assert kind == "RuntimeError" and f"xla:{q}" in msg and f"has one device, {d}" in msg, msg
        if r:
            kind, msg = o["errors"]["factory_0"]
            assert kind == "RuntimeError" and "xla:0 is not a device of this process" in msg, msg
        else:
            assert o["errors"]["factory_0"] is None
        assert o["to_0"] == d   # `.to("xla")` reaches the device as xla:0 (the guard's index)
        kind, msg = o["errors"]["beyond_job"]
        assert kind == "RuntimeError" and f"xla:{n}" in msg and d in msg, msg
        assert o["errors"]["device(1)"][0] == "IndexError" and d in o["errors"]["device(1)"][1]
        assert o["loaded_own"]["b"][0] == o["loaded_own"]["a"][0] == d
        _close(o["loaded_own"]["b"][1], b)
        _close(o["loaded_own"]["a"][1], a)
        kind, msg = o["loaded_other_error"]
        assert kind == "RuntimeError" and f"xla:{q}" in msg and "map_location" in msg, msg
        assert o["loaded_other"]["b"][0] == d
        _close(o["loaded_other"]["b"][1], workers.rank_input(q))
        assert o["master"][0] == "cpu"
        _close(o["master"][1], workers.rank_input(0))
        assert [x[0] for x in o["loader"]] == [d] * 3
        for k, (_, x) in enumerate(o["loader"]):
            _close(x, b * k)
        assert o["state_dict_devices"] == [d]
        for p, q in zip(o["train"]["params"], ref_params):
            _close(p, q, rtol=1e-5, atol=1e-5)
        assert o["train"]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


def test_device_index_rule():
    """xla:<global ordinal> only for a multi-process CPU job outside SPMD mode."""
    rule = pjrt.index_rule
    assert rule("CPU", 4, 2, False) == (2, True)
    assert rule("CPU", 4, 0, False) == (0, True)
    assert rule("CPU", 1, 0, False) == (0, False)
    assert rule("CPU", 4, 2, True) == (0, False)       # SPMD: one logical device, xla:0
    assert rule("CUDA", 4, 2, False) == (0, False)     # a process per GPU: its xla:0
    assert rule("TPU", 8, 5, False) == (0, False)


_ON_INDEX_3 = textwrap.dedent("""
    import torch, torch_xla
    from torch_xla._engine import patches, tensor
    tensor.set_device_index(3)           # as a replica of a CPU job decides it
    patches.install("inline_backward")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    ref = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(4, 5), torch.randn(4, 2)
    outs = {}
    for dev in ("cpu", "xla"):
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
        with torch.no_grad():
            for p, q in zip(m.parameters(), ref):
                p.copy_(q)
        m = m.to(dev)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        for step in range(3):   # the second and third steps take the specialised kernels
            opt.zero_grad()
            h = m(x.to(dev))
            loss = torch.nn.functional.mse_loss(h, y.to(dev)) + (h * h).mean() * 0.5
            loss.backward()
            opt.step()
            torch_xla.sync()
        devs = {str(t.device) for t in [h, loss] + list(m.parameters())
                + [p.grad for p in m.parameters()]
                + [v for st in opt.state.values() for k, v in st.items() if k != "step"]}  # Adam's step: CPU
        outs[dev] = ([p.detach().cpu() for p in m.parameters()], loss.item(), devs)
    for p, q in zip(outs["cpu"][0], outs["xla"][0]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert abs(outs["cpu"][1] - outs["xla"][1]) < 1e-5
    print("DEVICES", sorted(outs["xla"][2]))
""")


def test_training_on_another_index_matches_cpu():
    """One process whose device is xla:3 (a replica of a CPU job, without the job): every
    tensor of a training step (outputs, parameters, gradients, optimizer state) is on
    xla:3, through both the generic and the specialised kernels, and the step matches
    the CPU."""
    out = subprocess.run([sys.executable, "-c", _ON_INDEX_3], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DEVICES ['xla:3']" in out.stdout, out.stdout


@pytest.mark.parametrize("dtype", sorted(pjrt._TORCH_TO_NP, key=str))
def test_tensors_on_another_index_keep_their_metadata(dtype):
    """The creation function of a process on xla:3 gives what PyTorch's device-0
    constructor gives (sizes, strides, dtype, keys), on xla:3."""
    make = tensor._indexed_empty(3)
    for shape in [(), (5,), (2, 0, 3), (4, 1, 2), [3, 2]]:
        t, ref = make(shape, dtype), torch._C._acc.create_empty_tensor(shape, dtype)
        again = make(shape, dtype)   # from the cached prototype
        for x in (t, again):
            assert x.device == torch.device("xla", 3) and x.dtype == dtype
            assert x.shape == ref.shape and x.stride() == ref.stride()
            assert torch._C._dispatch_keys(x) == torch._C._dispatch_keys(ref)
        assert t is not again


# ---- failures ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failed_replica_stops_the_job(how, tmp_path):
    os.environ["TEST_PID_DIR"] = str(tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(launcher.ProcessFailedError) as ei:
            launcher.spawn(workers.failing_job, args=(how,), nprocs=2)
    finally:
        os.environ.pop("TEST_PID_DIR", None)
    elapsed = time.monotonic() - t0
    assert elapsed < 90, f"took {elapsed:.0f} s"
    err = ei.value
    assert err.rank == 1
    msg = str(err)
    assert "replica (process) 1 of 2" in msg
    if how == "raise":
        assert "ValueError: deliberate failure in replica 1" in msg
        assert "workers.py" in msg and "failing_job" in msg
        assert err.exitcode == 1
    else:
        assert "SIGKILL" in msg
    pids = [int(open(tmp_path / f"pid-{r}").read()) for r in range(2) if (tmp_path / f"pid-{r}").exists()]
    assert pids, "the replicas never reached the failure point"
    assert _pids_alive(pids) == []
    assert _child_pids(os.getpid()) == [], "processes left behind"


@pytest.mark.slow
def test_nonzero_exit_is_reported(tmp_path):
    os.environ["TEST_PID_DIR"] = str(tmp_path)
    try:
        with pytest.raises(launcher.ProcessFailedError) as ei:
            launcher.spawn(workers.failing_job, args=("exit",), nprocs=2)
    finally:
        os.environ.pop("TEST_PID_DIR", None)
    assert ei.value.rank == 1 and ei.value.exitcode == 3
    assert "exited with code 3" in str(ei.value)


# ---- launching without processes, and configuration errors --------------------------------

def _ret_index(index, x):
    return (index, x)


def test_single_process_runs_in_process():
    assert launcher.spawn(_ret_index, args=("a",), nprocs=1) == (0, "a")
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp
    assert xmp.spawn(_ret_index, args=("b",), nprocs=1) == (0, "b")
    old = os.environ.pop("CPU_NUM_DEVICES", None)
    try:
        assert torch_xla.launch(_ret_index, args=("c",)) == (0, "c")
        assert torch_xla.launch(_ret_index, args=("d",), debug_single_process=True) == (0, "d")
    finally:
        if old is not None:
            os.environ["CPU_NUM_DEVICES"] = old


def test_under_torchrun_spawn_calls_fn_with_local_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCH_XLA_JAX_PROCESS_ID", raising=False)
    import torch_xla
    assert launcher.spawn(_ret_index, args=("t",), nprocs=8) == (1, "t")
    assert torch_xla.launch(_ret_index, args=("u",)) == (1, "u")


def test_coordinator_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"coordinator port {port} .* already in use"):
            launcher.start_processes(_ret_index, args=(1,), nprocs=2, coordinator=f"127.0.0.1:{port}")


def test_wrong_world_size_and_rank(monkeypatch):
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401
    with pytest.raises(ValueError, match="world_size=3 but the XLA runtime has 1"):
        dist.init_process_group("xla", store=dist.HashStore(), rank=0, world_size=3)
    assert not dist.is_initialized()
    monkeypatch.setenv("TORCH_XLA_JAX_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCH_XLA_JAX_PROCESS_ID", "5")
    with pytest.raises(ValueError, match="rank 5 is out of range for world size 2"):
        job.check_environment()


def test_xla_init_without_launcher(monkeypatch):
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401
    for k in ("TORCH_XLA_JAX_COORDINATOR", "MASTER_ADDR", "MASTER_PORT", "TORCH_XLA_JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="no coordinator"):
        dist.init_process_group("xla", init_method="xla://")
    assert not dist.is_initialized()


def test_xla_init_single_process():
    """One process alone: `xla://` gives rank 0 of 1 and collectives are the identity."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist, torch_xla
        import torch_xla.distributed.xla_backend
        dist.init_process_group('xla', init_method='xla://')
        t = torch.ones(3, device=torch_xla.device())
        dist.all_reduce(t)
        objs = [None]
        dist.all_gather_object(objs, 'me')
        dist.barrier()
        print('OK', dist.get_rank(), dist.get_world_size(), t.cpu().tolist(), objs)
        dist.destroy_process_group()
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "WORLD_SIZE", "RANK")}
    env["PJRT_DEVICE"] = "CPU"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert "OK 0 1 [1.0, 1.0, 1.0] ['me']" in out.stdout, out.stderr[-3000:]


def test_importing_torch_xla_does_not_start_jax():
    code = ("import torch_xla, torch_xla.core.xla_model, torch_xla.distributed.xla_multiprocessing, "
            "torch_xla.distributed.xla_backend\n"
            "from torch_xla._engine import boot\n"
            "import jax._src.xla_bridge as xb\n"
            "print('STATE', not boot.started(), len(xb._backends))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert "STATE True 0" in out.stdout, out.stderr[-3000:]


# ---- reliability: a late replica --------------------------------------------------------

@pytest.mark.slow
def test_slow_replica_45s_before_first_collective():
    res = _spawn(workers.slow_job, args=(45.0,))
    assert res == {0: 3.0, 1: 3.0}


# ---- torchrun ---------------------------------------------------------------------------

def _torchrun_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCH_XLA_JAX_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                "MASTER_ADDR", "MASTER_PORT", "CPU_NUM_DEVICES")}
    env["PJRT_DEVICE"] = "CPU"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_torchrun_single_host():
    port = launcher.free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(SCRIPTS, "torchrun_allreduce.py")]
    out = subprocess.run(cmd, env=_torchrun_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for r in range(2):
        assert f"RESULT rank={r} world=2 sum=3.0 spawn_index={r} device=xla:{r}" in out.stdout


@pytest.mark.slow
def test_torchrun_two_hosts_simulated():
    port = launcher.free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}",
               os.path.join(SCRIPTS, "torchrun_allreduce.py")]
        procs.append(subprocess.Popen(cmd, env=_torchrun_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, o, e))
    for code, o, e in outs:
        assert code == 0, o[-3000:] + e[-3000:]
    text = outs[0][1] + outs[1][1]
    for r in range(4):
        assert f"RESULT rank={r} world=4 sum=10.0 spawn_index={r % 2} device=xla:{r}" in text


# ---- the MNIST example ------------------------------------------------------------------

def _losses(text):
    import re
    out = {}
    for dev, step, loss in re.findall(r"Device=(\S+) Epoch=1 Step=(\d+) Loss=([0-9.]+)", text):
        out.setdefault(int(step), []).append(float(loss))
    return {k: sum(v) / len(v) for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--ddp", "--pjrt_distributed"])
def test_mnist_example_two_processes_matches_one(flag):
    """2 replicas x 64 (lr scaled x2 by the example) vs 1 process x 128 with lr 0.02: the
    mean replica loss follows the single-process curve (BatchNorm statistics are per
    replica, hence the tolerance)."""
    script = os.path.join(REPO, "examples", "train_mnist_xla.py")
    common = ["--fake_data", "--num_steps", "30", "--log_steps", "5"]
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    two = subprocess.run([sys.executable, script, flag, "--batch_size", "64"] + common,
                         env=dict(env, CPU_NUM_DEVICES="2"), capture_output=True, text=True, timeout=400)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = subprocess.run([sys.executable, script, "--batch_size", "128", "--lr", "0.02"] + common,
                         env=dict(env, CPU_NUM_DEVICES="1"), capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    l2, l1 = _losses(two.stdout), _losses(one.stdout)
    assert sorted(l1) == sorted(l2) == [0, 5, 10, 15, 20, 25]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=0.02), (step, l1, l2)
    assert l2[25] < 0.5 * l2[0]


def test_functional_collectives_eager_and_compiled():
    res = _spawn(workers.functional_collectives_job)
    x = [workers.rank_input(r, (4,)) for r in range(2)]
    for r in range(2):
        o = res[r]
        _close(o["all_reduce"], x[0] + x[1])
        _close(o["all_reduce_max"], torch.maximum(x[0], x[1]))
        _close(o["all_gather"], torch.cat(x))
        _close(o["reduce_scatter"], (x[0] + x[1])[2 * r:2 * r + 2])
        _close(o["all_to_all"], torch.cat([x[0][2 * r:2 * r + 2], x[1][2 * r:2 * r + 2]]))
        _close(o["broadcast"], x[1])
        for k in range(2):
            _close(o["compiled"][k], (x[0] + k) * 2 + (x[1] + k) * 2 + 1)


def test_all_reduce_inside_torch_compile():
    res = _spawn(workers.compiled_all_reduce_job, args=(2,))
    for r in range(2):
        for k, out in enumerate(res[r]):
            _close(out, sum(x.add(k) * 2 for x in _inputs(2)) + 1)
