"""Inference (forward only, eval mode, torch.no_grad): decoder-only transformer and
ResNet-18-shaped CNN, at the training benchmark's sizes.

    PJRT_DEVICE=CPU python bench/bench_inference.py [--quick] [--models decoder,resnet18]
                                                    [--original-venv PATH]

Same protocol as bench_training.py: fresh subprocess per contender, warm-up, rounds of
forward passes, each round ending with a wait for the device (xm.wait_device_ops() /
block_until_ready); the outputs stay on the device (no transfer of the logits).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCHEDULE = {"decoder": (3, 5, 3), "resnet18": (3, 5, 5)}
QUICK_SCHEDULE = (2, 3, 2)


def _rounds(step, sync, rounds, steps):
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(steps):
            out = step()
        sync(out)
        times.append((common.now() - t0) / steps)
    return times


def worker_xla(wl, warmup, rounds, steps):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    common.set_threads()
    stats = common.XlaCompileStats()
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model().to(dev)
    model.eval()
    x = wl.make_batch(0)[0].to(dev)

    def step():
        with torch.no_grad():
            out = model(x)
        xm.mark_step()
        return out

    def sync(out):
        xm.wait_device_ops()

    t0 = common.now()
    out = step()
    sync(out)
    first_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    sync(None)
    c0, _ = stats.snapshot()
    times = _rounds(step, sync, rounds, steps)
    c1, ctime = stats.snapshot()
    checksum = float(step().float().abs().mean().cpu())
    return {"step_times": times, "first_step_s": first_s, "compiles": c1, "compile_s": ctime,
            "compiles_after_warmup": c1 - c0, "fallback_ops": stats.fallback_ops(),
            "checksum": checksum}


def worker_eager(wl, warmup, rounds, steps):
    import torch
    common.set_threads()
    torch.manual_seed(0)
    model = wl.make_model()
    model.eval()
    x = wl.make_batch(0)[0]

    def step():
        with torch.no_grad():
            return model(x)
    t0 = common.now()
    step()
    first_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    times = _rounds(step, lambda o: None, rounds, steps)
    return {"step_times": times, "first_step_s": first_s,
            "checksum": float(step().abs().mean())}


def worker_jax(wl, warmup, rounds, steps):
    import torch
    import jax
    common.set_threads()
    import models_jax as mj
    torch.manual_seed(0)
    model = wl.make_model()
    model.eval()
    fwd, params, bufs = mj.make_eval_step(wl, model)
    x = mj.to_jax(wl.make_batch(0)[0])
    jax.block_until_ready((params, bufs, x))
    cc = mj.CompileCounter()   # counts the forward's compilations, not the set-up's

    def step():
        return fwd(params, bufs, x)
    t0 = common.now()
    step().block_until_ready()
    first_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    jax.block_until_ready(step())
    c0 = cc.count
    times = _rounds(step, lambda o: o.block_until_ready(), rounds, steps)
    c1 = cc.count
    checksum = float(abs(step()).mean())
    return {"step_times": times, "first_step_s": first_s, "compiles": c1,
            "compile_s": cc.total_s, "compiles_after_warmup": c1 - c0, "checksum": checksum}


WORKERS = {"xla": worker_xla, "eager": worker_eager, "jax": worker_jax}


def run_worker_main(args):
    import models_torch
    wa = common.parse_worker_args(args)
    name = wa["model"]
    wl = models_torch.workload(name, quick=args.quick)
    warmup, rounds, steps = QUICK_SCHEDULE if args.quick else SCHEDULE[name]
    r = WORKERS[args.worker](wl, warmup, rounds, steps)
    r["batch"] = wl.batch
    r["step_ms"] = common.median(r["step_times"]) * 1e3
    r["samples_s"] = wl.batch / common.median(r["step_times"])
    common.emit(r)


COLUMNS = [("samples_s", "samples/s"), ("step_ms", "forward ms (median)"),
           ("peak_rss_mb", "peak RSS MiB"), ("compiles", "compiles"),
           ("compile_s", "compile s"), ("compiles_after_warmup", "compiles after warm-up"),
           ("first_step_s", "first forward s"), ("checksum", "mean |output|")]


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="decoder,resnet18")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    for name in args.models.split(","):
        results = {}
        for c in common.contenders_of(args):
            print(f"[inference {name}] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"model": name})
        table = common.markdown_table(
            f"Inference: {name}" + (" (quick sizes)" if args.quick else ""), results, COLUMNS,
            ratio_key="samples_s", command=common.command_line())
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
