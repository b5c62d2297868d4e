"""Replica functions for tests/test_multiprocess.py (importable, so `spawn` can pickle them).

Each returns CPU values; the test computes the expected values on the CPU from every
replica's inputs (a replica's inputs are a function of its rank only).
"""
from __future__ import annotations

import os
import signal
import time

import torch


def rank_input(rank: int, shape=(2, 3), dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (rank + 1) + rank * 0.5 + 1).to(dtype)


# ---- every collective -------------------------------------------------------------------

def collectives_job(index: int, with_dist: bool = False):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    out = {"rank": r, "world": n, "index": index, "local_ordinal": xr.local_ordinal()}
    x = rank_input(r).to(dev)
    ints = torch.tensor([r + 1, 3 * r + 2, 7], dtype=torch.int32).to(dev)
    bools = torch.tensor([r == 0, True, False]).to(dev)
    for rt in ("sum", "mul", "min", "max"):
        out[f"all_reduce_{rt}"] = xm.all_reduce(rt, x)
    out["all_reduce_and_int"] = xm.all_reduce("and", ints)
    out["all_reduce_or_int"] = xm.all_reduce("or", ints)
    out["all_reduce_and_bool"] = xm.all_reduce("and", bools)
    out["all_reduce_or_bool"] = xm.all_reduce("or", bools)
    out["all_reduce_scale"] = xm.all_reduce("sum", x, scale=0.5)
    pairs = [[i, i + 1] for i in range(0, n, 2)] if n % 2 == 0 else None
    if pairs:
        out["all_reduce_groups"] = xm.all_reduce("sum", x, groups=pairs)
    lst = [x.clone(), ints.clone()]
    ret = xm.all_reduce("sum", lst)
    out["all_reduce_list_same"] = ret is lst
    out["all_reduce_list"] = list(lst)
    out["all_gather_0"] = xm.all_gather(x, dim=0)
    out["all_gather_1"] = xm.all_gather(x, dim=1)
    if pairs:
        out["all_gather_groups"] = xm.all_gather(x, dim=0, groups=pairs)
    buf = torch.zeros(2 * n, 3, device=dev)
    ret = xm.all_gather(x, dim=0, output=buf)
    out["all_gather_output"] = buf
    big = rank_input(r, (2 * n, 3)).to(dev)
    out["reduce_scatter"] = xm.reduce_scatter("sum", big, 1.0, 0, n)
    out["reduce_scatter_scaled"] = xm.reduce_scatter("sum", big, 1.0 / n, 0, n)
    out["all_to_all"] = xm.all_to_all(big, 0, 0, n)
    perm = [(i, (i + 1) % n) for i in range(n)]
    out["collective_permute"] = xm.collective_permute(x, perm)
    torch_xla.sync()
    payloads = xm.rendezvous("payload_test", f"payload-{r}".encode())
    out["rendezvous"] = [bytes(p) for p in payloads]
    xm.rendezvous("no_payload")
    out["mesh_reduce"] = xm.mesh_reduce("mr", r + 1, sum)
    out["mesh_reduce_tensor"] = xm.mesh_reduce("mr_t", torch.tensor([float(r)]), lambda v: torch.stack(v).sum(0))
    torch_xla.sync()
    out = _cpu(out)
    if with_dist:
        out["dist"] = dist_job(index, "xla")
    return out


def broadcast_master_param_job(index: int, watchdog_s: float = 120.0):
    """Replicas start from different parameters; afterwards all hold the master's."""
    import faulthandler
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    faulthandler.dump_traceback_later(watchdog_s, exit=True)  # a hang fails the test, not the suite
    dev = torch_xla.device()
    r = xr.global_ordinal()
    torch.manual_seed(100 + r)
    m = torch.nn.Linear(3, 2).to(dev)
    xm.broadcast_master_param(m)
    torch_xla.sync()
    res = [p.detach().cpu() for p in m.parameters()]
    faulthandler.cancel_dump_traceback_later()
    return res


def _cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


# ---- torch.distributed on the xla backend ----------------------------------------------

def dist_job(index: int, init: str = "xla"):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401
    import torch_xla.runtime as xr

    if init == "xla":
        dist.init_process_group("xla", init_method="xla://")
    elif init == "env":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = os.environ["TEST_DIST_PORT"]
        dist.init_process_group("xla", rank=xr.global_ordinal(), world_size=xr.world_size())
    dev = torch_xla.device()
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"rank": r, "world": n, "backend": dist.get_backend()}
    x = rank_input(r).to(dev)
    t = x.clone()
    dist.all_reduce(t)
    out["all_reduce"] = t
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = t
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = t
    outs = [torch.zeros(2, 3, device=dev) for _ in range(n)]
    dist.all_gather(outs, x)
    out["all_gather"] = outs
    big = torch.zeros(2 * n, 3, device=dev)
    dist.all_gather_into_tensor(big, x)
    out["all_gather_into_tensor"] = big
    inp = rank_input(r, (2 * n, 3)).to(dev)
    rs = torch.zeros(2, 3, device=dev)
    dist.reduce_scatter_tensor(rs, inp)
    out["reduce_scatter_tensor"] = rs
    rs2 = torch.zeros(2, 3, device=dev)
    dist.reduce_scatter(rs2, list(inp.chunk(n)))
    out["reduce_scatter"] = rs2
    b = x.clone()
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = b
    a2a = torch.zeros(2 * n, 3, device=dev)
    dist.all_to_all_single(a2a, inp)
    out["all_to_all_single"] = a2a
    if n >= 2:
        if r == 0:
            dist.send(x * 10, dst=1)
        elif r == 1:
            got = torch.zeros(2, 3, device=dev)
            dist.recv(got, src=0)
            out["recv"] = got
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "s": "x" * (r + 1)})
    out["all_gather_object"] = objs
    lst = [f"from-{r}", r]
    dist.broadcast_object_list(lst, src=n - 1)
    out["broadcast_object_list"] = lst
    dist.barrier()
    work = dist.all_reduce(x.clone(), async_op=True)
    work.wait()
    out["async_completed"] = work.is_completed()
    torch_xla.sync()
    res = _cpu(out)
    dist.destroy_process_group()
    return res


# ---- training ---------------------------------------------------------------------------

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def global_batches(steps: int, global_batch: int):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(global_batch, 8, generator=g), torch.randn(global_batch, 4, generator=g))
            for _ in range(steps)]


def reference_training(steps: int, global_batch: int, lr: float = 0.1):
    """One process, CPU, the concatenated batch: the expected parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in global_batches(steps, global_batch):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach() for p in model.parameters()], losses


def train_both_job(index: int, steps: int, global_batch: int):
    return {mode: train_job(index, mode, steps, global_batch) for mode in ("optimizer_step", "ddp")}


def train_job(index: int, mode: str, steps: int, global_batch: int, lr: float = 0.1):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    per = global_batch // n
    model = make_model().to(dev)
    if mode == "ddp":
        import torch.distributed as dist
        import torch_xla.distributed.xla_backend  # noqa: F401
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("xla", init_method="xla://")
        model = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in global_batches(steps, global_batch):
        x, y = x[r * per:(r + 1) * per].to(dev), y[r * per:(r + 1) * per].to(dev)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if mode == "ddp":
            opt.step()
        else:
            xm.optimizer_step(opt)
        torch_xla.sync()
        losses.append(xm.all_reduce("sum", loss.detach(), scale=1.0 / n))
    torch_xla.sync()
    params = [p.detach().cpu() for p in model.parameters()]
    if mode == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    return {"rank": r, "params": params, "losses": [float(l.cpu()) for l in losses]}


# ---- device numbering -------------------------------------------------------------------

def _error(fn):
    """(exception type name, message) of what `fn()` raises, None when it raises nothing."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test checks the type)
        return type(e).__name__, str(e)
    return None


def device_numbering_job(index: int, tmpdir: str, steps: int, global_batch: int):
    """What a replica sees of its device: names, tensors, gradients (and the device inside
    a backward), another replica's device, saving and loading, the loader, a training step."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr

    r, n = xr.global_ordinal(), xr.world_size()
    dev = torch_xla.device()
    out = {"rank": r, "index": index, "device": str(dev), "xla_device": str(xm.xla_device()),
           "device_0": str(torch_xla.device(0)), "devices": [str(d) for d in torch_xla.devices()],
           "supported": xm.get_xla_supported_devices(), "count": torch_xla.device_count(),
           "addressable": xr.addressable_device_count(), "current": torch.xla.current_device(),
           "default": torch_xla._XLAC._xla_get_default_device(), "real": torch_xla.real_devices()}
    a = torch.arange(6.0, device="xla").reshape(2, 3)        # `xla`: this process's device
    b = rank_input(r).to(dev)
    made = {"factory": a, "to": b, "op": a * b + 1, "view": b[1], "reduction": b.sum(),
            "matmul": a @ b.T, "to_index": rank_input(r).to(f"xla:{r}"), "like": torch.ones_like(b)}
    out["tensor_devices"] = {k: str(v.device) for k, v in made.items()}
    # Distinct tensors of one shape never share a storage (PyTorch would take them for
    # aliases): the ops' outputs and two fresh factories of a's shape.
    from torch_xla._engine.tensor import unwrap
    same_shape = [a, made["op"], torch.zeros(2, 3, device="xla"), torch.zeros(2, 3, device="xla")]
    out["storages"] = len({unwrap(t).untyped_storage()._cdata for t in same_shape})
    out["values"] = {k: v.cpu() for k, v in made.items()}

    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward_ordinal"] = xr.global_ordinal()
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["backward_ordinal"] = xr.global_ordinal()
            seen["backward_device"] = str(torch_xla.device())
            seen["grad_output_device"] = str(g.device)
            return g * 3

    w = b.clone().requires_grad_(True)
    (Probe.apply(w).sin() * w).sum().backward()
    out["backward"] = seen
    out["grad_device"] = str(w.grad.device)
    out["grad"] = w.grad.cpu()

    # Another replica's index: q, neither 0 nor r. `xla:0` in `.to` (and torch.tensor) is
    # also what PyTorch makes of an index-less `xla` there, so it means this process's device.
    q = 1 if r != 1 else 2
    out["other"] = f"xla:{q}"
    out["errors"] = {"factory": _error(lambda: torch.zeros(2, device=f"xla:{q}")),
                     "to": _error(lambda: b.to(f"xla:{q}")),
                     "tensor": _error(lambda: torch.tensor([1.0], device=f"xla:{q}")),
                     "factory_0": _error(lambda: torch.zeros(2, device="xla:0")),
                     "beyond_job": _error(lambda: torch.ones(2, device=f"xla:{n}")),
                     "device(1)": _error(lambda: torch_xla.device(1))}
    out["to_0"] = str(b.to("xla:0").device)

    # Device tensors saved as they are load back here; another replica's load here only
    # with a map_location (as in PyTorch/XLA, where that device is not this process's).
    torch.save({"b": b, "a": a}, os.path.join(tmpdir, f"dev-{r}.pt"))
    xm.save({"b": b}, os.path.join(tmpdir, "master.pt"))   # rank 0 writes, on the CPU; all wait
    xm.rendezvous("device_numbering_saved")
    mine = torch.load(os.path.join(tmpdir, f"dev-{r}.pt"), weights_only=False)
    out["loaded_own"] = {k: (str(v.device), v.cpu()) for k, v in mine.items()}
    theirs = os.path.join(tmpdir, f"dev-{q}.pt")
    out["loaded_other_error"] = _error(lambda: torch.load(theirs, weights_only=False))
    moved = torch.load(theirs, weights_only=False, map_location={f"xla:{q}": "xla"})
    out["loaded_other"] = {k: (str(v.device), v.cpu()) for k, v in moved.items()}
    master = torch.load(os.path.join(tmpdir, "master.pt"))
    out["master"] = (str(master["b"].device), master["b"])

    loader = pl.MpDeviceLoader([(rank_input(r) * k,) for k in range(3)], dev)
    out["loader"] = [(str(x.device), x.cpu()) for (x,) in loader]

    model = make_model().to(dev)
    sd = model.state_dict()
    out["state_dict_devices"] = sorted({str(v.device) for v in sd.values()})
    out["train"] = train_job(index, "optimizer_step", steps, global_batch)
    return out


# ---- failures ---------------------------------------------------------------------------

def failing_job(index: int, how: str, victim: int = 1):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    r = xr.global_ordinal()
    t = xm.all_reduce("sum", torch.ones(2, device=dev))
    torch_xla.sync()
    with open(os.path.join(os.environ["TEST_PID_DIR"], f"pid-{r}"), "w") as f:
        f.write(str(os.getpid()))
    if r == victim:
        if how == "raise":
            raise ValueError(f"deliberate failure in replica {r}")
        if how == "exit":
            raise SystemExit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    # The survivors block in a collective that the failed replica never joins.
    t = xm.all_reduce("sum", t)
    torch_xla.sync()
    time.sleep(600)
    return t.cpu()


def slow_job(index: int, delay: float):
    """One replica reaches its first collective `delay` seconds after the others."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    if r == n - 1:
        time.sleep(delay)
    t = xm.all_reduce("sum", torch.tensor([float(r + 1)]).to(dev))
    torch_xla.sync()
    return float(t.cpu()[0])


# ---- a collective inside torch.compile --------------------------------------------------

def compiled_all_reduce_job(index: int, steps: int = 2):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    def reduce(t):
        return xm.all_reduce(xm.REDUCE_SUM, t * 2) + 1

    compiled = torch.compile(reduce, backend="openxla", fullgraph=True)
    r = xr.global_ordinal()
    return [compiled(rank_input(r, (2, 3)).add(k).to(torch_xla.device())).cpu() for k in range(steps)]


def functional_collectives_job(index: int):
    """torch.distributed._functional_collectives on xla tensors, eager and inside torch.compile."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401
    import torch_xla.runtime as xr

    dist.init_process_group("xla", init_method="xla://")
    w = dist.group.WORLD
    r, dev = xr.global_ordinal(), torch_xla.device()
    t = rank_input(r, (4,)).to(dev)
    out = {
        "all_reduce": funcol.all_reduce(t, "sum", w),
        "all_reduce_max": funcol.all_reduce(t, "max", w),
        "all_gather": funcol.all_gather_tensor(t, 0, w),
        "reduce_scatter": funcol.reduce_scatter_tensor(t, "sum", 0, w),
        "all_to_all": funcol.all_to_all_single(t, [2, 2], [2, 2], w),
        "broadcast": funcol.broadcast(t, 1, w),
    }
    step = torch.compile(lambda x: funcol.all_reduce(x * 2, "sum", w) + 1, backend="openxla", fullgraph=True)
    out["compiled"] = [step(t.add(k)) for k in range(2)]
    return {k: [x.cpu() for x in v] if isinstance(v, list) else v.cpu() for k, v in out.items()}


def use_spmd_job(index: int):
    """A replica asks for SPMD mode: refused (one process per device is replication)."""
    import torch_xla.runtime as xr
    try:
        xr.use_spmd()
    except RuntimeError as e:
        return f"refused: {e}"
    return "accepted"
