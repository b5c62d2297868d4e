"""Resident host memory vs fresh mmaps on the CPU device, interleaved in one process.

    PJRT_DEVICE=CPU python bench/bench_host_memory.py [--models decoder,resnet18,mnist]
                                                       [--rounds 5] [--quick]

First the cost of a page fault here: the time to first touch 1 GiB of fresh anonymous
memory, per 4 KiB page. Then, per model, training steps of this project in two modes that
alternate round by round in one process (the drift of a shared machine hits both alike):
- `mmap`: glibc's default for large blocks (fresh mmap per block, munmap on free), the
  dispatch of large programs not paced;
- `retained`: this project's default on CPU (torch_xla/_engine/platform/host_memory.py): one arena,
  no mmap, no trimming, and a large program dispatched once the previous one's temporary
  buffer is free.
Prints the median step time, the minor page faults per step and the peak RSS of the
process (both modes share one process: the peak is the larger of the two).
"""
from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

_GLIBC_DEFAULT_TRIM, _GLIBC_DEFAULT_MMAP_MAX = 128 * 1024, 65536


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fault_cost(size=1 << 30, repeats=3):
    """Median microseconds per first-touch page fault over `repeats` fresh mappings."""
    import numpy as np
    costs = []
    for _ in range(repeats):
        m = mmap.mmap(-1, size)
        a = np.frombuffer(m, dtype=np.uint8)
        f0, t0 = _faults(), time.perf_counter()
        a[::4096] = 1
        dt, n = time.perf_counter() - t0, _faults() - f0
        costs.append(dt / max(n, 1) * 1e6)
        del a
        m.close()
    return statistics.median(costs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="decoder,resnet18,mnist")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="quick sizes, 2 rounds")
    args = p.parse_args(argv)
    import torch
    import torch_xla
    import models_torch
    from torch_xla._engine.platform import host_memory

    torch.set_num_threads(2)
    rounds = 2 if args.quick else args.rounds
    dev = torch_xla.device()
    torch.zeros(1, device=dev).cpu()  # the client exists, host_memory configured
    if not host_memory.active():
        sys.exit("host_memory is not active (PT_XLA_RETAIN_HOST_MEMORY=0 or not glibc)")
    libc = host_memory._glibc()
    trim_threshold, mmap_max = host_memory._M_TRIM_THRESHOLD, host_memory._M_MMAP_MAX
    gate = (host_memory.before_dispatch, host_memory.after_dispatch)

    def mode(name):
        if name == "mmap":
            libc.mallopt(mmap_max, _GLIBC_DEFAULT_MMAP_MAX)
            libc.mallopt(trim_threshold, _GLIBC_DEFAULT_TRIM)
            host_memory.release()
            host_memory.before_dispatch = lambda: 0
            host_memory.after_dispatch = lambda temp, used_before, outs: None
        else:
            libc.mallopt(mmap_max, 0)  # as host_memory.configure()
            libc.mallopt(trim_threshold, 2 ** 31 - 1)
            host_memory.before_dispatch, host_memory.after_dispatch = gate

    print(f"`PJRT_DEVICE=CPU python bench/bench_host_memory.py --models {args.models} "
          f"--rounds {rounds}{' --quick' if args.quick else ''}`\n")
    print(f"first touch of fresh memory: {fault_cost():.2f} us per 4 KiB page\n")
    print("| model | mode | step ms (median) | minor faults per step | largest temp MiB |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        wl = models_torch.workload(name, quick=args.quick)
        steps = 2 if name != "mnist" else 10
        step = common.xla_training_step(wl)

        for _ in range(3):
            step()
        step().item()
        from torch_xla._engine.executor import compile as compiling
        temp = max((e.paced for exes in compiling._cache.values() for e in exes), default=0)
        times = {"mmap": [], "retained": []}
        faults = {"mmap": [], "retained": []}
        for _ in range(rounds):
            for m in times:
                mode(m)
                step().item()  # the first step of a mode pays its switch
                f0, t0 = _faults(), time.perf_counter()
                for _ in range(steps):
                    loss = step()
                loss.item()
                times[m].append((time.perf_counter() - t0) / steps)
                faults[m].append((_faults() - f0) / steps)
        for m in times:
            print(f"| {name} | {m} | {statistics.median(times[m]) * 1e3:,.1f} | "
                  f"{statistics.median(faults[m]):,.0f} | {temp / 2**20:,.0f} |")
        del step
        compiling.clear_cache()
    mode("retained")
    print(f"\npeak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10:,} MiB")


if __name__ == "__main__":
    main()
