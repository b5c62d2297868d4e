"""Patch matrices for convolutions on CPU: one slice per kernel offset (k1 * k2 slices,
the engine's earlier formulation, kept here) vs one spatial dimension at a time (k1 + k2
slices, `lowering/conv_cpu.conv_im2col`), inside a whole training step, in one process.

    PJRT_DEVICE=CPU python bench/bench_patches.py [--model mnist] [--rounds 15]

Traces one training step of a benchmark model (bench/models_torch.py) on the xla device,
lowers the same graph once per formulation, compiles both (compile time) and runs them in
alternation on the same buffers (A, B, A, B, ...), so the drift of a shared machine hits
both alike. Prints StableHLO op counts, compile times, median and minimum step times
and the largest relative difference between the programs' outputs.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def per_offset_im2col(x, w, stride, padding, dilation):
    """The patches as one strided slice per kernel offset, stacked."""
    import jax.numpy as jnp
    from jax import lax
    from torch_xla._engine.lowering import conv_cpu
    nsp = x.ndim - 2
    n, c = x.shape[:2]
    o = w.shape[0]
    k = w.shape[2:]
    out = tuple(conv_cpu._out_size(x.shape[2 + i], k[i], stride[i], padding[i], dilation[i]) for i in range(nsp))
    xp = jnp.pad(jnp.moveaxis(x, 1, -1), ((0, 0),) + tuple((p, p) for p in padding) + ((0, 0),))
    slices = []
    for off in itertools.product(*(range(kk) for kk in k)):
        start = (0,) + tuple(a * d for a, d in zip(off, dilation)) + (0,)
        limit = (n,) + tuple(st + (m - 1) * s + 1 for st, m, s in zip(start[1:-1], out, stride)) + (c,)
        slices.append(lax.slice(xp, start, limit, (1,) + tuple(stride) + (1,)))
    patches = jnp.stack(slices, axis=-2).reshape((n * math.prod(out), len(slices) * c))
    wm = jnp.moveaxis(w, (0, 1), (-1, -2)).reshape((len(slices) * c, o))
    y = jnp.matmul(patches, wm, precision=lax.Precision.HIGHEST).reshape((n,) + out + (o,))
    return jnp.moveaxis(y, -1, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist", help="mnist or resnet18")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    import torch
    import common
    import models_torch
    from torch_xla._engine import graph_executor, runtime
    from torch_xla._engine.lowering import conv_cpu
    jax = runtime.jax_module()
    import jax.numpy as jnp

    torch.set_num_threads(2)
    graph, params = common.traced_step_graph(models_torch.workload(args.model))
    opts = graph_executor.compiler_options(graph)
    engine = conv_cpu.conv_im2col
    variants = {"one slice per offset": per_offset_im2col, "one dimension at a time (engine)": engine}
    exes, info = {}, {}
    try:
        for name, impl in variants.items():
            conv_cpu.conv_im2col = impl
            lowered = jax.jit(graph.build_fn(), keep_unused=True).lower(*params)
            t0 = time.perf_counter()
            exes[name] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
            info[name] = (lowered.as_text().count("stablehlo."), time.perf_counter() - t0)
    finally:
        conv_cpu.conv_im2col = engine
    outs = [e(*params) for e in exes.values()]
    diff = max(float(jnp.abs(a - b).max() / (jnp.abs(a).max() + 1e-30))
               for other in outs[1:] for a, b in zip(outs[0], other) if a.size)
    times = {k: [] for k in exes}
    for _ in range(args.rounds):
        for name, exe in exes.items():
            jax.block_until_ready(exe(*params))
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*params))
            times[name].append(time.perf_counter() - t0)
    print(f"`PJRT_DEVICE=CPU python bench/bench_patches.py --model {args.model} --rounds {args.rounds}`\n")
    print("| patches | StableHLO ops | compile s | step ms (median) | step ms (min) |")
    print("|---|---|---|---|---|")
    for name in exes:
        ops, cs = info[name]
        print(f"| {name} | {ops} | {cs:.2f} | {statistics.median(times[name]) * 1e3:.1f} | "
              f"{min(times[name]) * 1e3:.1f} |")
    print(f"\nlargest relative difference between the programs' outputs: {diff:.1e}")


if __name__ == "__main__":
    main()
