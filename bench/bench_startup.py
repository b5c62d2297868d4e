"""Start-up latency: a fresh process's imports, first op and first inference forward.

    PJRT_DEVICE=CPU python bench/bench_startup.py [--original-venv PATH] [--rounds 3]

Each round launches one fresh process per contender (contenders alternate, so the drift
of a shared machine hits them alike) which times, from its launch: the imports (torch,
and torch_xla for the xla contenders); the first op (`(a + b) * 2`, 64x64, read back to
the host); the first forward of the MNIST CNN (`eval()`, `no_grad()`, batch 128, read
back). Reports medians over rounds and whether `torch._dynamo` got imported on the way
(it costs seconds; nothing in these steps needs it). No optimizer is built: a training
script's `torch.optim` imports torch._dynamo itself, for every contender alike.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _steps(dev, sync, read):
    import torch
    import models_torch
    t0 = time.time()
    a = torch.ones(64, 64, device=dev)
    b = torch.full((64, 64), 2.0, device=dev)
    v = read(((a + b) * 2).sum())
    t1 = time.time()
    wl = models_torch.workload("mnist")
    torch.manual_seed(0)
    model = wl.make_model().to(dev).eval()
    x, _ = wl.make_batch(0)
    with torch.no_grad():
        out = model(x.to(dev))
        sync()
        w = read(out.abs().mean())
    t2 = time.time()
    assert v == 6 * 64 * 64, v
    return t0, t1, t2, w


def worker_xla(args):
    import torch  # noqa: F401  (timed: the import itself)
    import torch_xla
    import torch_xla.core.xla_model as xm
    t_imports = time.time()
    common.set_threads()
    t0, t1, t2, w = _steps(torch_xla.device(), xm.mark_step, lambda t: t.item())
    return {"t_imports": t_imports, "t0": t0, "t1": t1, "t2": t2, "out": w,
            "dynamo": "torch._dynamo" in sys.modules}


def worker_eager(args):
    import torch
    t_imports = time.time()
    common.set_threads()
    t0, t1, t2, w = _steps(torch.device("cpu"), lambda: None, lambda t: t.item())
    return {"t_imports": t_imports, "t0": t0, "t1": t1, "t2": t2, "out": w,
            "dynamo": "torch._dynamo" in sys.modules}


WORKERS = {"xla": worker_xla, "eager": worker_eager}

COLUMNS = [("imports_s", "launch to imports done s"), ("first_op_s", "first op s"),
           ("first_fwd_s", "first MNIST forward s"), ("total_s", "launch to first forward s"),
           ("dynamo", "torch._dynamo imported"), ("out", "mean |output|")]


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.worker:
        r = WORKERS[args.worker](args)
        r["process_start"] = common.process_start_time()
        common.emit(r)
        return
    names = common.contenders_of(args, available=("xla", "eager", "original"))
    runs = {n: [] for n in names}
    for i in range(1 if args.quick else args.rounds):
        for n in names:
            print(f"[startup] {n} round {i + 1} ...", file=sys.stderr, flush=True)
            r = common.run_worker(__file__, n, args)
            if "t2" in r:
                start = r.get("process_start") or r["t_launch"]
                r["imports_s"] = r["t_imports"] - start
                r["first_op_s"] = r["t1"] - r["t0"]
                r["first_fwd_s"] = r["t2"] - r["t1"]
                r["total_s"] = r["t2"] - start
            runs[n].append(r)
    results = {}
    for n, rs in runs.items():
        ok = [r for r in rs if "total_s" in r]
        if not ok:
            results[n] = rs[-1]
            continue
        res = {k: statistics.median(r[k] for r in ok) for k in ("imports_s", "first_op_s", "first_fwd_s", "total_s")}
        res["dynamo"] = any(r["dynamo"] for r in ok)
        res["out"] = ok[0]["out"]
        results[n] = res
    print(common.markdown_table(
        "Start-up: launch, imports, first op, first forward (medians)", results, COLUMNS,
        ratio_key="total_s", higher_is_better=False, command=common.command_line(),
        notes=["fresh process per contender and round, contenders alternating; no optimizer built"]))


if __name__ == "__main__":
    main()
