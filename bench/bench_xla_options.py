"""XLA compiler options A/B on one training step of this project, in one process.

    PJRT_DEVICE=CPU python bench/bench_xla_options.py --model decoder \\
        --variants '{"default": {}, "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""}}'

Traces one training step (or, with --inference, one forward) of a benchmark model (bench/models_torch.py) on the xla
device, lowers it once (twice when a variant holds `"_native_conv": true`: convolutions as XLA
convolutions instead of the CPU policy's patch products), compiles it once per variant (`Lowered.compile(compiler_options=
...)`: XLA debug options by name) and runs the executables in alternation (A, B, A, B,
...) on the same buffers, so the drift of a shared machine hits every variant alike.
Each variant is compiled `--compiles` times (variants alternating); prints the median
compile wall time and process CPU time (XLA compiles on a thread pool: CPU time counts
every thread), the median / min of the execution times, and whether the variant's outputs
equal the first variant's bit for bit.
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
    p.add_argument("--model", default="decoder",
                   help="mnist, decoder, resnet18, or decoder8 (the decoder at batch 8 x 256)")
    p.add_argument("--variants", default='{"default": {}, "no-ynn": {"xla_cpu_experimental_ynn_fusion_type": ""}}',
                   help="JSON object: variant name -> {XLA option: value}")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inference", action="store_true", help="the forward only (eval, no_grad)")
    p.add_argument("--quick", action="store_true", help="quick sizes, 2 rounds")
    p.add_argument("--compiles", type=int, default=3, help="compilations per variant (medians reported)")
    args = p.parse_args(argv)
    import jax
    import torch
    import common
    import models_torch

    torch.set_num_threads(2)
    variants = json.loads(args.variants)
    rounds = 2 if args.quick else args.rounds
    wl = (models_torch.decoder_workload(8, 256) if args.model == "decoder8" and not args.quick
          else models_torch.workload(args.model.replace("decoder8", "decoder"), quick=args.quick))
    graph, params = common.traced_step_graph(wl, inference=args.inference)
    from torch_xla._engine.executor.lower import build_fn
    # A variant naming "_native_conv": true lowers convolutions as XLA convolutions instead of
    # the CPU policy's patch products (the formulation measured against XLA's library paths).
    lowerings = {}

    def lowered_for(opts):
        patch = not opts.get("_native_conv", False)
        if patch not in lowerings:
            lowerings[patch] = jax.jit(build_fn(graph, patch), keep_unused=True).lower(*params)
        return lowerings[patch]

    exes = {}
    print(f"`PJRT_DEVICE=CPU python bench/bench_xla_options.py --model {args.model} "
          f"--variants '{args.variants}'{' --inference' if args.inference else ''}"
          f"{' --quick' if args.quick else ''}`\n")
    print("| variant | options | compile s (wall) | compile s (CPU) | step ms (median) | step ms (min) "
          "| outputs = first variant's | run to run equal |")
    print("|---|---|---|---|---|---|---|---|")
    import numpy as np
    compile_s = {k: [] for k in variants}
    compile_cpu = {k: [] for k in variants}
    for _ in range(max(1, args.compiles)):
        for name, opts in variants.items():
            # A real compilation each time: jax keeps executables per lowering and options.
            jax.clear_caches()
            t0, c0 = time.perf_counter(), time.process_time()
            exes[name] = lowered_for(opts).compile(
                compiler_options={k: v for k, v in opts.items() if not k.startswith("_")})
            compile_s[name].append(time.perf_counter() - t0)
            compile_cpu[name].append(time.process_time() - c0)
    outs = {k: [np.asarray(o) for o in jax.tree_util.tree_leaves(exe(*params))] for k, exe in exes.items()}
    first = next(iter(outs.values()))
    same = {k: all(a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(v, first))
            for k, v in outs.items()}
    # Run to run: a second execution of each executable on the same inputs, bit for bit.
    again = {k: all(a.tobytes() == np.asarray(b).tobytes()
                    for a, b in zip(outs[k], jax.tree_util.tree_leaves(exe(*params))))
             for k, exe in exes.items()}
    times = {k: [] for k in exes}
    for _ in range(rounds):
        for name, exe in exes.items():
            jax.block_until_ready(exe(*params))
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*params))
            times[name].append(time.perf_counter() - t0)
    for name in exes:
        print(f"| {name} | `{json.dumps(variants[name])}` | {statistics.median(compile_s[name]):.2f} | "
              f"{statistics.median(compile_cpu[name]):.2f} | {statistics.median(times[name]) * 1e3:.1f} | "
              f"{min(times[name]) * 1e3:.1f} | {'yes' if same[name] else 'no'} | "
              f"{'yes' if again[name] else 'NO'} |")


if __name__ == "__main__":
    main()
