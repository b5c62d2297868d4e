"""XLA compiler options A/B on one training step of this project, in one process.

    PJRT_DEVICE=CPU python bench/bench_xla_options.py --model decoder \\
        --variants '{"default": {}, "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""}}'

Traces one training step (or, with --inference, one forward) of a benchmark model (bench/models_torch.py) on the xla
device, lowers it once, compiles it once per variant (`Lowered.compile(compiler_options=
...)`: XLA debug options by name) and runs the executables in alternation (A, B, A, B,
...) on the same buffers, so the drift of a shared machine hits every variant alike.
Prints compile time and the median / min of the execution times per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="decoder", help="mnist, decoder or resnet18")
    p.add_argument("--variants", default='{"default": {}, "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""}}',
                   help="JSON object: variant name -> {XLA option: value}")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inference", action="store_true", help="the forward only (eval, no_grad)")
    p.add_argument("--quick", action="store_true", help="quick sizes, 2 rounds")
    args = p.parse_args(argv)
    import jax
    import torch
    import common
    import models_torch

    torch.set_num_threads(2)
    variants = json.loads(args.variants)
    rounds = 2 if args.quick else args.rounds
    graph, params = common.traced_step_graph(models_torch.workload(args.model, quick=args.quick),
                                             inference=args.inference)
    from torch_xla._engine.executor.lower import build_fn
    lowered = jax.jit(build_fn(graph, True), keep_unused=True).lower(*params)

    exes = {}
    print(f"`PJRT_DEVICE=CPU python bench/bench_xla_options.py --model {args.model} "
          f"--variants '{args.variants}'{' --inference' if args.inference else ''}"
          f"{' --quick' if args.quick else ''}`\n")
    print("| variant | options | compile s | step ms (median) | step ms (min) |")
    print("|---|---|---|---|---|")
    compile_s = {}
    for name, opts in variants.items():
        t0 = time.perf_counter()
        exes[name] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
        compile_s[name] = time.perf_counter() - t0
    times = {k: [] for k in exes}
    for _ in range(rounds):
        for name, exe in exes.items():
            jax.block_until_ready(exe(*params))
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*params))
            times[name].append(time.perf_counter() - t0)
    for name in exes:
        print(f"| {name} | `{json.dumps(variants[name])}` | {compile_s[name]:.1f} | "
              f"{statistics.median(times[name]) * 1e3:.1f} | {min(times[name]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
