"""Python's garbage collector during tracing: share of tracing time spent collecting.

    PJRT_DEVICE=CPU python bench/bench_gc.py [--pending 1,20] [--pairs 3]

Traces K chains of 1000 x `z = z + y` (64x64) before one barrier, so K*1000 ops are
pending when the collector runs. Each measurement is a fresh process; the collector's
time comes from `gc.callbacks` (thread CPU time), tracing time from `time.thread_time`.
Runs alternate `PT_XLA_TUNE_GC=0` (collector as Python sets it) and the default (import
objects frozen, youngest generation collected every 10,000 net allocations).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def worker(k: int) -> dict:
    import gc
    import time
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    dev = torch_xla.device()
    y = (torch.rand(64, 64) / 64).to(dev)
    z0 = torch.rand(64, 64)

    def run(z):
        for _ in range(1000):
            z = z + y
        return z

    run(z0.to(dev))
    xm.mark_step()
    xm.wait_device_ops()
    spent = [0.0]

    def cb(phase, info):
        if phase == "start":
            cb.t = time.thread_time()
        else:
            spent[0] += time.thread_time() - cb.t
    gc.callbacks.append(cb)
    traced = 0.0
    for _ in range(10):
        zs = [z0.to(dev) for _ in range(k)]
        xm.mark_step()
        xm.wait_device_ops()
        t0 = time.thread_time()
        outs = [run(z) for z in zs]
        traced += time.thread_time() - t0
        xm.mark_step()
        xm.wait_device_ops()
        del outs
    return {"us_per_op": traced / (10 * k * 1000) * 1e6, "gc_share": spent[0] / traced}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pending", default="1,20", help="chains pending per barrier")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--worker", type=int, default=0)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker)))
        return
    print("| pending ops | collector | us per op (median) | collection share of tracing (median) |")
    print("|---|---|---|---|")
    for k in (int(x) for x in a.pending.split(",")):
        res = {"0": [], "1": []}
        for _ in range(a.pairs):
            for tune in ("0", "1"):
                env = dict(os.environ, PT_XLA_TUNE_GC=tune, PJRT_DEVICE="CPU")
                out = subprocess.run([sys.executable, __file__, "--worker", str(k)], env=env,
                                     capture_output=True, text=True, check=True).stdout
                res[tune].append(json.loads(out.strip().splitlines()[-1]))
        for tune, label in (("0", "Python default"), ("1", "tuned (default here)")):
            us = statistics.median(r["us_per_op"] for r in res[tune])
            share = statistics.median(r["gc_share"] for r in res[tune])
            print(f"| {k * 1000} | {label} | {us:.2f} | {share * 100:.0f}% |", flush=True)
    print(f"\n`PJRT_DEVICE=CPU python bench/bench_gc.py --pending {a.pending} --pairs {a.pairs}`")


if __name__ == "__main__":
    main()
