"""Training throughput: MNIST CNN, decoder-only transformer, ResNet-18-shaped CNN.

    PJRT_DEVICE=CPU python bench/bench_training.py [--quick] [--models mnist,decoder,resnet18]
                                                   [--original-venv PATH]

Each contender runs in its own fresh subprocess: build the model (torch.manual_seed(0), so
every contender starts from the same weights), one fixed fake batch, `warmup` steps, then
`rounds` rounds of `steps` steps; each round ends with a host read of the loss, so the
round's time covers the device work. Step time = median over rounds of round time / steps;
samples/s = batch / step time. The xla contenders report the CompileTime metric (count,
total) and the compilations after warm-up, which must be zero.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# (warmup, rounds, steps per round)
SCHEDULE = {
    "mnist": (5, 10, 10),
    "decoder": (3, 5, 2),
    "resnet18": (3, 5, 3),
}
QUICK_SCHEDULE = (3, 3, 2)


def _timed_rounds(step, sync, rounds, steps):
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(steps):
            out = step()
        sync(out)
        times.append((common.now() - t0) / steps)
    return times


def worker_xla(wl, warmup, rounds, steps):
    import torch_xla.core.xla_model as xm
    common.set_threads()
    stats = common.XlaCompileStats()
    step = common.xla_training_step(wl)

    t0 = common.now()
    first_loss = step().item()
    first_step_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    xm.wait_device_ops()
    c0, _ = stats.snapshot()
    times = _timed_rounds(step, lambda loss: loss.item(), rounds, steps)
    last_loss = step().item()
    c1, ctime = stats.snapshot()
    return {"step_times": times, "first_loss": first_loss, "last_loss": last_loss,
            "first_step_s": first_step_s, "compiles": c1, "compile_s": ctime,
            "compiles_after_warmup": c1 - c0, "fallback_ops": stats.fallback_ops()}


def worker_eager(wl, warmup, rounds, steps):
    step = common.eager_training_step(wl)
    t0 = common.now()
    first_loss = step().item()
    first_step_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    times = _timed_rounds(step, lambda loss: loss.item(), rounds, steps)
    return {"step_times": times, "first_loss": first_loss, "last_loss": step().item(),
            "first_step_s": first_step_s}


def worker_jax(wl, warmup, rounds, steps):
    import torch
    import jax
    common.set_threads()
    import models_jax as mj
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    train_step, params, opt_state, bufs = mj.make_train_step(wl, model)
    x, y = (mj.to_jax(t) for t in wl.make_batch(0))
    jax.block_until_ready((params, opt_state, bufs))
    cc = mj.CompileCounter()   # counts the train step's compilations, not the set-up's
    state = [params, opt_state, bufs]

    def step():
        loss, state[0], state[1], state[2] = train_step(state[0], state[1], state[2], x, y)
        return loss

    t0 = common.now()
    first_loss = float(step())
    first_step_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    jax.block_until_ready(state)
    c0 = cc.count
    times = _timed_rounds(step, lambda loss: float(loss), rounds, steps)
    last_loss = float(step())
    return {"step_times": times, "first_loss": first_loss, "last_loss": last_loss,
            "first_step_s": first_step_s, "compiles": cc.count, "compile_s": cc.total_s,
            "compiles_after_warmup": cc.count - c0}


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


COLUMNS = [("samples_s", "samples/s"), ("step_ms", "step ms (median)"),
           ("peak_rss_mb", "peak RSS MiB"), ("compiles", "compiles"),
           ("compile_s", "compile s"), ("compiles_after_warmup", "compiles after warm-up"),
           ("first_step_s", "first step s"), ("first_loss", "loss step 1"),
           ("last_loss", "loss last")]


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(("mnist", "decoder", "resnet18")))
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    for name in args.models.split(","):
        results = {}
        for c in common.contenders_of(args):
            print(f"[training {name}] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"model": name})
        table = common.markdown_table(
            f"Training: {name}" + (" (quick sizes)" if args.quick else ""), results, COLUMNS,
            ratio_key="samples_s", command=common.command_line())
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
