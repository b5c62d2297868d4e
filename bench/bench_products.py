"""Matrix products on the CPU: XLA's own against the platform's BLAS handler
(platform/cpu_blas.py) against eager PyTorch.

    PJRT_DEVICE=CPU python bench/bench_products.py [--parts products,steps]
        [--models decoder8,mnist] [--rounds 20] [--steps-rounds 16]

`products`: the float32 products of the decoder's training step (bench/models_torch.py at
batch 8 x 256: projections forward (`x·Wᵀ`), input gradients (`g·W`), weight gradients
(`gᵀ·x`), attention's six batched products), each as a one-product program compiled by
XLA (a `dot_general`) and with the handler (transposed operands passed as flags),
interleaved in this process, and eager PyTorch (2 threads) in a process of its own (its
OpenMP threads spin after each call and would slow XLA's threads if they shared one);
median ms (min) per product and the sums.
`steps`: each model's whole training-step program (common.traced_step_graph) lowered twice,
with and without the handler (`build_fn(..., library_products=)`), run alternately on the
same buffers: median / min ms per step and process CPU ms per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

N = 2048
# name, lhs shape, rhs shape, (lhs transposed, rhs transposed); the operands are stored
# transposed where the flag is set
PRODUCTS = [
    ("x·Wᵀ 256->256", (N, 256), (256, 256), (False, True)),
    ("x·Wᵀ 256->1024", (N, 256), (1024, 256), (False, True)),
    ("x·Wᵀ 1024->256", (N, 1024), (256, 1024), (False, True)),
    ("x·Wᵀ head 256->3200", (N, 256), (3200, 256), (False, True)),
    ("g·W 256<-1024", (N, 1024), (1024, 256), (False, False)),
    ("g·W head", (N, 3200), (3200, 256), (False, False)),
    ("gᵀ·x 1024x256", (N, 1024), (N, 256), (True, False)),
    ("gᵀ·x 256x1024", (N, 256), (N, 1024), (True, False)),
    ("gᵀ·x head 3200x256", (N, 3200), (N, 256), (True, False)),
    ("q·kᵀ (64 x 256x32x256)", (64, 256, 32), (64, 256, 32), (False, True)),
    ("p·v (64 x 256x256x32)", (64, 256, 256), (64, 256, 32), (False, False)),
    ("pᵀ·g (64 x 256x256x32)", (64, 256, 256), (64, 256, 32), (True, False)),
]


def _timed(f, rounds):
    f()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _operands(rng, ls, rs):
    return rng.standard_normal(ls, dtype=np.float32), rng.standard_normal(rs, dtype=np.float32)


def eager_worker(rounds: int) -> None:
    """Eager's side of `products`, in a process of its own: PyTorch's OpenMP threads keep
    spinning for a while after each product and would slow XLA's threads in a shared
    process (and XLA's would slow them). Prints one JSON list: [median ms, min ms] per product."""
    import torch
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    out = []
    for _, ls, rs, (ta, tb) in PRODUCTS:
        a, b = (torch.from_numpy(x) for x in _operands(rng, ls, rs))
        a = a.transpose(-1, -2) if ta else a
        b = b.transpose(-1, -2) if tb else b
        t = _timed(lambda: torch.matmul(a, b), rounds)
        out.append([statistics.median(t), min(t)])
    print(json.dumps(out))


def products(rounds: int) -> str:
    import jax
    from jax import lax
    from torch_xla._engine.lowering import blas_cpu
    from torch_xla._engine.platform import cpu_blas
    assert cpu_blas.available(), "the handler is not available (PT_XLA_CPU_BLAS=0, or no native part)"
    eager = json.loads(subprocess.run([sys.executable, os.path.abspath(__file__), "--eager-worker", "--rounds",
                                       str(rounds)], check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    rng = np.random.default_rng(0)
    rows = ["| product | XLA ms | handler ms | eager ms | XLA / eager | handler / eager |", "|---|---|---|---|---|---|"]
    sums = [0.0, 0.0, 0.0]
    for (name, ls, rs, (ta, tb)), (e_med, e_min) in zip(PRODUCTS, eager):
        a, b = _operands(rng, ls, rs)
        nb = len(ls) - 2
        batch = (tuple(range(nb)), tuple(range(nb)))
        dn = (((nb if ta else nb + 1,), (nb + 1 if tb else nb,)), batch)
        xla = jax.jit(lambda x, y, dn=dn: lax.dot_general(x, y, dn, precision=lax.Precision.HIGHEST))
        lib = jax.jit(lambda x, y, ta=ta, tb=tb: blas_cpu.product(x, y, ta, tb))
        ja, jb = jax.device_put(a), jax.device_put(b)
        fs = [lambda: xla(ja, jb).block_until_ready(), lambda: lib(ja, jb).block_until_ready()]
        times = [[], []]
        for _ in range(rounds):   # interleaved
            for i, f in enumerate(fs):
                times[i] += _timed(f, 1)
        med = [statistics.median(t) for t in times] + [e_med]
        mins = [min(t) for t in times] + [e_min]
        sums = [s + m for s, m in zip(sums, med)]
        rows.append(f"| {name} | {med[0]:.2f} ({mins[0]:.2f}) | {med[1]:.2f} ({mins[1]:.2f}) | "
                    f"{med[2]:.2f} ({mins[2]:.2f}) | {med[0] / med[2]:.2f} | {med[1] / med[2]:.2f} |")
    rows.append(f"| sum of medians | {sums[0]:.1f} | {sums[1]:.1f} | {sums[2]:.1f} | {sums[0] / sums[2]:.2f} | "
                f"{sums[1] / sums[2]:.2f} |")
    return "\n".join(rows)


def steps(models, rounds: int) -> str:
    import jax
    import models_torch as mt
    from torch_xla._engine.executor.compile import platform_policy
    from torch_xla._engine.executor.lower import build_fn
    from torch_xla._engine.platform.base import ALL_PRODUCTS, NO_PRODUCTS
    pol = platform_policy()
    rows = ["| model | handler calls | XLA: ms median (min) | handler: ms median (min) | CPU ms XLA / handler | "
            "handler / XLA |", "|---|---|---|---|---|---|"]
    for model in models:
        wl = mt.decoder_workload(batch=8, seq=256) if model == "decoder8" else mt.workload(model)
        graph, params = common.traced_step_graph(wl)
        exes, calls = {}, 0
        for on in (False, True):
            blas = ALL_PRODUCTS if on and pol.library_products() else NO_PRODUCTS
            fn = build_fn(graph, pol.patch_convolutions, checks=True, widen_int4_dots=pol.widen_int4_dots,
                          library_products=blas)
            exes[on] = jax.jit(fn, keep_unused=True).lower(*params).compile(
                compiler_options=pol.compiler_options(graph.op_avals(), blas))
            if on:
                calls = exes[on].as_text().count("custom_call_target=\"torch_xla_cpu_matmul_f32\"")
            jax.block_until_ready(exes[on](*params))
        wall = {False: [], True: []}
        cpu = {False: [], True: []}
        for r in range(rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                c0, t0 = time.process_time(), time.perf_counter()
                jax.block_until_ready(exes[on](*params))
                wall[on].append((time.perf_counter() - t0) * 1e3)
                cpu[on].append((time.process_time() - c0) * 1e3)
        mx, mh = statistics.median(wall[False]), statistics.median(wall[True])
        rows.append(f"| {model} | {calls} | {mx:.1f} ({min(wall[False]):.1f}) | {mh:.1f} ({min(wall[True]):.1f}) | "
                    f"{statistics.median(cpu[False]):.0f} / {statistics.median(cpu[True]):.0f} | {mh / mx:.2f} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="products,steps")
    p.add_argument("--models", default="decoder8,mnist")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps-rounds", type=int, default=16)
    p.add_argument("--eager-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.eager_worker:
        return eager_worker(args.rounds)
    parts = args.parts.split(",")
    print(f"`PJRT_DEVICE=CPU python bench/bench_products.py --parts {args.parts} --models {args.models} "
          f"--rounds {args.rounds} --steps-rounds {args.steps_rounds}`\n")
    print(f"load average {common.load_average()} before")
    if "products" in parts:
        print("\n" + products(args.rounds))
    if "steps" in parts:
        print("\n" + steps(args.models.split(","), args.steps_rounds))
    print(f"\nload average {common.load_average()} after")


if __name__ == "__main__":
    main()
