"""The device's random generator (SplitMix64, torch_xla/_engine/lowering/prng.py) vs jax's
default threefry2x32: compile time and run time of programs shaped like the random ops'
lowerings, both generators interleaved in one process.

    PJRT_DEVICE=CPU python bench/bench_rng.py [--rounds 3]

Programs (the step's seed as a parameter, folded with the op's number, as the engine
does): `x * rand_like(x)` on 128x1024 f32; an MLP forward with six dropout sites;
randperm(1000); randn float64 128x1024. Each round compiles every program afresh (a new
jit per round, so jax's caches do not answer) and runs it 20 times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _programs(impl):
    import jax.numpy as jnp
    from jax import random as jr

    def key(s, i):
        return jr.fold_in(jr.key(s, impl=impl), i)

    def rand_mul(s, x):
        return x * jr.uniform(key(s, 0), x.shape, jnp.float32)

    def dropout_mlp(s, x):
        w = jnp.full((1024, 1024), 1e-3, jnp.float32)
        for i in range(6):
            keep = jr.bernoulli(key(s, i), 0.9, x.shape)
            x = jnp.where(keep, x / 0.9, 0.0) @ w
        return x

    def randperm(s, x):
        return jr.permutation(key(s, 0), jnp.arange(1000, dtype=jnp.int64))

    def randn64(s, x):
        return jr.normal(key(s, 0), x.shape, jnp.float64)

    return {"rand_mul": rand_mul, "dropout_mlp": dropout_mlp, "randperm": randperm, "randn64": randn64}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import numpy as np
    import torch_xla  # noqa: F401  (the engine's jax set-up: x64, platform)
    from torch_xla._engine import pjrt
    from torch_xla._engine.lowering import prng
    jax = pjrt.jax_module()
    import jax.numpy as jnp

    gens = {"threefry2x32 (jax default)": "threefry2x32", "splitmix64 (this project)": prng.impl()}
    x = jnp.ones((128, 1024), jnp.float32)
    seed = np.uint32(1234)
    comp = {}
    run = {}
    for r in range(args.rounds):
        for gname, impl in gens.items():
            for pname, fn in _programs(impl).items():
                t0 = time.perf_counter()
                c = jax.jit(fn).lower(seed, x).compile()
                comp.setdefault((gname, pname), []).append(time.perf_counter() - t0)
                c(seed, x).block_until_ready()
                t0 = time.perf_counter()
                for _ in range(20):
                    out = c(seed, x)
                out.block_until_ready()
                run.setdefault((gname, pname), []).append((time.perf_counter() - t0) / 20)
        print(f"[rng] round {r + 1}/{args.rounds}", file=sys.stderr)
    names = list(_programs("threefry2x32"))
    print("### Random generator: compile and run time per program\n")
    print(f"`PJRT_DEVICE=CPU python bench/bench_rng.py --rounds {args.rounds}` (medians over rounds)\n")
    print("| program | " + " | ".join(f"{g}: compile s, run ms" for g in gens) + " | compile ratio | run ratio |")
    print("|---|" + "---|" * (len(gens) + 2))
    g0, g1 = list(gens)
    for pname in names:
        cells = []
        for g in gens:
            cells.append(f"{statistics.median(comp[(g, pname)]):.3f}, {statistics.median(run[(g, pname)]) * 1e3:.3f}")
        cr = statistics.median(comp[(g1, pname)]) / statistics.median(comp[(g0, pname)])
        rr = statistics.median(run[(g1, pname)]) / statistics.median(run[(g0, pname)])
        print(f"| {pname} | " + " | ".join(cells) + f" | {cr:.2f} | {rr:.2f} |")


if __name__ == "__main__":
    main()
