"""`xla_builder.call_jax`: the cost of one call while tracing (cache hit), of a trace
(cache miss), and of a step of N calls against the same step written as torch ops.

    PJRT_DEVICE=CPU python bench/bench_call_jax.py [--calls 1000] [--repeats 5]

Per call: `call_jax(f, (a, b))` on 64x64 tensors with no barrier (the node is built,
nothing runs), with and without an input requiring grad. Miss: a fresh cache each time
(the function traced to a jaxpr). For scale: one torch op (`a + b`). Step: N chained calls then `torch_xla.sync()` and a
host read, second run onwards (the program compiled once).
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax.numpy as jnp
    import torch
    import torch_xla
    import torch_xla.core.xla_builder as xb

    dev = torch_xla.device()

    def f(a, b):
        return a * jnp.sin(b) + 1

    a, b = torch.randn(64, 64).to(dev), torch.randn(64, 64).to(dev)
    g = torch.randn(64, 64).to(dev).requires_grad_()

    def per_call(x) -> float:
        xb.call_jax(f, (x, b))
        t0 = time.perf_counter()
        for _ in range(args.calls):
            xb.call_jax(f, (x, b))
        dt = (time.perf_counter() - t0) / args.calls
        torch_xla.sync()
        return dt

    def per_torch_op() -> float:
        t0 = time.perf_counter()
        for _ in range(args.calls):
            a + b
        dt = (time.perf_counter() - t0) / args.calls
        torch_xla.sync()
        return dt

    def per_miss() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            xb._JAX_TO_XLA_COMPUTATION_CACHE.clear()
            xb.call_jax(f, (a, b))
        torch_xla.sync()
        return (time.perf_counter() - t0) / 20

    def step(use_jax: bool) -> float:
        t0 = time.perf_counter()
        z = a
        for _ in range(50):
            z = xb.call_jax(f, (z, b)) if use_jax else z * torch.sin(b) + 1
        torch_xla.sync()
        z.cpu()
        return time.perf_counter() - t0

    rows = {
        "call (hit, no grad)": [per_call(a) for _ in range(args.repeats)],
        "call (hit, requires grad)": [per_call(g) for _ in range(args.repeats)],
        "call (miss: trace)": [per_miss() for _ in range(args.repeats)],
        "one torch op (a + b), for scale": [per_torch_op() for _ in range(args.repeats)],
    }
    step(True), step(False)
    rows["step of 50 call_jax"] = [step(True) for _ in range(args.repeats)]
    rows["step of 50 x (mul, sin, add) torch ops"] = [step(False) for _ in range(args.repeats)]
    for name, xs in rows.items():
        print(f"{name:40s} median {statistics.median(xs) * 1e6:10.1f} us  (min {min(xs) * 1e6:.1f})")


if __name__ == "__main__":
    main()
