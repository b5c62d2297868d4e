"""Where a training step's time goes on the xla device: host tracing, the barrier, and
the program's execution, and whether tracing overlaps execution.

    PJRT_DEVICE=CPU python bench/bench_step_phases.py [--model mnist] [--steps 60]

This project only, one process. After a warm-up, runs `--steps` steps that each wait
for the device (`xm.wait_device_ops()` after `xm.mark_step()`) and reports the medians
of: tracing (zero_grad, forward, backward, optimizer step), the barrier call
(`mark_step`, which dispatches the program asynchronously) and the wait for the
program; the process CPU time per step (all threads: > wall time means XLA's threads
ran in parallel). Then the same number of steps without the wait (the usual loop,
tracing step n+1 while step n executes), wall time per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist", help="mnist, decoder or resnet18")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    import common
    import models_torch
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    common.set_threads()
    trace = common.xla_training_step(models_torch.workload(args.model), barrier=False)

    # Every loop keeps the loss alive across the barrier (it is one of the program's
    # outputs), so all steps run the same compiled program.
    for _ in range(args.warmup):
        loss = trace()
        xm.mark_step()
    xm.wait_device_ops()
    compiles = met.metric_data("CompileTime")[0]

    traced, barrier, wait, total = [], [], [], []
    c0 = os.times()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = trace()
        t1 = time.perf_counter()
        xm.mark_step()
        t2 = time.perf_counter()
        xm.wait_device_ops()
        t3 = time.perf_counter()
        traced.append(t1 - t0)
        barrier.append(t2 - t1)
        wait.append(t3 - t2)
        total.append(t3 - t0)
    c1 = os.times()
    cpu = ((c1.user - c0.user) + (c1.system - c0.system)) / args.steps

    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = trace()
        xm.mark_step()
    loss.item()
    assert met.metric_data("CompileTime") is None or met.metric_data("CompileTime")[0] == compiles, \
        "a step compiled after the warm-up"
    pipelined = (time.perf_counter() - t0) / args.steps

    ms = lambda v: f"{statistics.median(v) * 1e3:.2f}"
    print(f"`PJRT_DEVICE=CPU python bench/bench_step_phases.py --model {args.model} --steps {args.steps}`\n")
    print("| model | tracing ms | barrier call ms | wait for the program ms | step, waiting ms | "
          "process CPU ms per step | step, not waiting ms |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {ms(traced)} | {ms(barrier)} | {ms(wait)} | {ms(total)} | {cpu * 1e3:.2f} | "
          f"{pipelined * 1e3:.2f} |")


if __name__ == "__main__":
    main()
