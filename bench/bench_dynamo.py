"""Training through torch.compile(backend='openxla') vs lazy tracing vs eager CPU.

    PJRT_DEVICE=CPU python bench/bench_dynamo.py [--quick] [--models mnist,decoder]
                                                 [--contenders dynamo,lazy,eager]
                                                 [--original-venv PATH]

Each contender runs in its own fresh subprocess (bench/common.py): the workload's model
(torch.manual_seed(0)), one fixed batch, `warmup` steps, then `rounds` rounds of `steps`
steps; each round ends with a host read of the loss (and, on the device, waiting for
every program dispatched: `xm.wait_device_ops()`). A step is zero_grad, forward + loss,
backward, optimizer step, then xm.mark_step() on the device. For `dynamo` the whole step
function goes through torch.compile(backend='openxla') (Dynamo splits it into graphs at
`backward()`; each graph runs its cached executable); `lazy` traces every op each step.
With --original-venv, `original_dynamo` and `original_lazy` run the same two workers
under the original torch_xla 2.9 (that venv's python).

Columns: host ms per step (median of the time the Python step call takes: tracing and
dispatch, no waiting), step ms (median round time / steps, the device work included),
samples/s = batch / step time, compilations after warm-up (must be 0).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCHEDULE = {"mnist": (5, 10, 10), "decoder": (3, 5, 2)}
QUICK_SCHEDULE = (3, 3, 2)


def _measure(step, sync, warmup, rounds, steps):
    t0 = common.now()
    first_loss = sync(step())
    first_step_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    sync(step())
    host, times = [], []
    for _ in range(rounds):
        r0 = common.now()
        for _ in range(steps):
            h0 = common.now()
            out = step()
            host.append(common.now() - h0)
        sync(out)
        times.append((common.now() - r0) / steps)
    return {"step_times": times, "host_times": host, "first_loss": first_loss,
            "last_loss": sync(step()), "first_step_s": first_step_s}


def _xla_step(wl, compiled: bool):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model().to(dev)
    model.train()
    opt = wl.make_opt(model.parameters())
    x, y = (t.to(dev) for t in wl.make_batch(0))

    def train_step(x, y):
        opt.zero_grad()
        loss = wl.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss

    fn = torch.compile(train_step, backend="openxla") if compiled else train_step

    def step():
        loss = fn(x, y)
        xm.mark_step()
        return loss
    return step


def worker_xla_mode(wl, compiled, warmup, rounds, steps):
    common.set_threads()
    stats = common.XlaCompileStats()
    import torch_xla.core.xla_model as xm
    step = _xla_step(wl, compiled)

    def sync(loss):
        # The loss is ready when the forward is: a round ends when the backward and the
        # optimizer step of its last step are done too (wait_device_ops), or a contender
        # that dispatches ahead would leave part of its last step out of the round.
        value = loss.item()
        xm.wait_device_ops()
        return value

    r = _measure(step, sync, warmup, 1, 1)   # warm-up and compile
    c0, _ = stats.snapshot()
    r = dict(_measure(step, sync, 1, rounds, steps), first_loss=r["first_loss"],
             first_step_s=r["first_step_s"])
    c1, ctime = stats.snapshot()
    r.update(compiles=c1, compile_s=ctime, compiles_after_warmup=c1 - c0, fallback_ops=stats.fallback_ops())
    return r


def worker_dynamo(wl, warmup, rounds, steps):
    return worker_xla_mode(wl, True, warmup, rounds, steps)


def worker_lazy(wl, warmup, rounds, steps):
    return worker_xla_mode(wl, False, warmup, rounds, steps)


def worker_eager(wl, warmup, rounds, steps):
    step = common.eager_training_step(wl)
    return _measure(step, lambda loss: loss.item(), warmup, rounds, steps)


WORKERS = {"dynamo": worker_dynamo, "lazy": worker_lazy, "eager": worker_eager}
CONTENDERS = ("dynamo", "lazy", "original_dynamo", "original_lazy", "eager")
LABELS = {"dynamo": "torch.compile(backend='openxla')", "lazy": "lazy tracing (xm.mark_step)",
          "original_dynamo": "original 2.9: torch.compile(backend='openxla')",
          "original_lazy": "original 2.9: lazy tracing (xm.mark_step)",
          "eager": "torch eager CPU (2 threads)"}
COLUMNS = [("samples_s", "samples/s"), ("step_ms", "step ms"), ("host_ms", "host ms/step"),
           ("compiles", "compiles"), ("compile_s", "compile s"),
           ("compiles_after_warmup", "compiles after warm-up"), ("first_step_s", "first step s"),
           ("first_loss", "loss step 1"), ("last_loss", "loss last"), ("peak_rss_mb", "peak RSS MiB")]


def run_worker_main(args):
    import models_torch
    name = common.parse_worker_args(args)["model"]
    wl = models_torch.workload(name, quick=args.quick)
    warmup, rounds, steps = QUICK_SCHEDULE if args.quick else SCHEDULE[name]
    r = WORKERS[args.worker](wl, warmup, rounds, steps)
    r["batch"] = wl.batch
    r["step_ms"] = common.median(r["step_times"]) * 1e3
    r["host_ms"] = common.median(r["host_times"]) * 1e3
    r["samples_s"] = wl.batch / common.median(r["step_times"])
    common.emit(r)


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="mnist,decoder")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    for name in args.models.split(","):
        results = {}
        for c in common.contenders_of(args, available=CONTENDERS):
            print(f"[dynamo {name}] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"model": name})
        table = common.markdown_table(f"Training through torch.compile: {name}" + (" (quick sizes)" if args.quick else ""),
                                      results, COLUMNS, ratio_key="samples_s", command=common.command_line(),
                                      labels=LABELS)
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
