"""Tracing cost: microseconds per traced op, host side (the Python loop only, timed before
the barrier).

    PJRT_DEVICE=CPU python bench/bench_tracing.py [--quick] [--original-venv PATH]

Chains (64x64 float32):
  add      1000 x `z = z + y`                              (1000 ops)
  mm_chain 250 x `z = relu(z @ y * 0.5 + 1.0)`             (1000 ops)

xla contenders: the loop records the graph (timed), then xm.mark_step() compiles/executes
it (not timed in us/op; reported as "barrier ms"). One warm-up repetition first, so the
graph is compiled and every later repetition must hit the compile cache.
For reference: eager torch runs each op (us/op = dispatch + kernel), and jax's tracer
(jax.make_jaxpr of the same Python loop) is the cost of tracing the chain in jax.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHAINS = {"add": (1000, 1), "mm_chain": (250, 4)}   # name: (iterations, ops per iteration)


def chain_fn(name, relu):
    if name == "add":
        def run(z, y, n):
            for _ in range(n):
                z = z + y
            return z
    else:
        def run(z, y, n):
            for _ in range(n):
                z = relu(z @ y * 0.5 + 1.0)
            return z
    return run


def worker_xla(name, reps, n, ops):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    common.set_threads()
    stats = common.XlaCompileStats()
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    y0 = (torch.rand(64, 64, generator=g) / 64)
    z0 = torch.rand(64, 64, generator=g)
    y = y0.to(dev)
    run = chain_fn(name, torch.relu)
    trace_us, barrier_ms = [], []
    c0 = None
    for i in range(reps + 1):
        z = z0.to(dev)
        xm.mark_step()
        xm.wait_device_ops()
        t0 = common.now()
        z = run(z, y, n)
        t1 = common.now()
        xm.mark_step()
        xm.wait_device_ops()
        t2 = common.now()
        if i == 0:
            c0, _ = stats.snapshot()
            continue
        trace_us.append((t1 - t0) / (n * ops) * 1e6)
        barrier_ms.append((t2 - t1) * 1e3)
    c1, ctime = stats.snapshot()
    return {"us_per_op": common.median(trace_us), "barrier_ms": common.median(barrier_ms),
            "compiles": c1, "compile_s": ctime, "compiles_after_warmup": c1 - c0,
            "fallback_ops": stats.fallback_ops(), "checksum": float(z.cpu().mean())}


def worker_eager(name, reps, n, ops):
    import torch
    common.set_threads()
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(64, 64, generator=g) / 64)
    z0 = torch.rand(64, 64, generator=g)
    run = chain_fn(name, torch.relu)
    times = []
    for i in range(reps + 1):
        t0 = common.now()
        z = run(z0.clone(), y, n)
        if i:
            times.append((common.now() - t0) / (n * ops) * 1e6)
    return {"us_per_op": common.median(times), "checksum": float(z.mean())}


def worker_jax(name, reps, n, ops):
    import jax
    import jax.numpy as jnp
    import numpy as np
    common.set_threads()
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.random((64, 64), dtype=np.float32) / 64)
    z0 = jnp.asarray(rng.random((64, 64), dtype=np.float32))
    run = chain_fn(name, jax.nn.relu)
    times = []
    for i in range(reps + 1):
        t0 = common.now()
        jax.make_jaxpr(lambda z, y: run(z, y, n))(z0, y)
        if i:
            times.append((common.now() - t0) / (n * ops) * 1e6)
    return {"us_per_op": common.median(times)}


WORKERS = {"xla": worker_xla, "eager": worker_eager, "jax": worker_jax}


def run_worker_main(args):
    wa = common.parse_worker_args(args)
    name = wa["chain"]
    n, ops = CHAINS[name]
    reps = 3 if args.quick else 15
    common.emit(WORKERS[args.worker](name, reps, n, ops))


COLUMNS = [("us_per_op", "us per traced op (median)"), ("barrier_ms", "barrier ms"),
           ("compiles", "compiles"), ("compile_s", "compile s"),
           ("compiles_after_warmup", "compiles after warm-up"), ("peak_rss_mb", "peak RSS MiB")]

TITLES = {"add": "1000 x `z = z + y` (64x64 f32)",
          "mm_chain": "250 x `relu(z @ y * 0.5 + 1.0)` (1000 ops)"}


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--chains", default="add,mm_chain")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    for name in args.chains.split(","):
        results = {}
        for c in common.contenders_of(args):
            print(f"[tracing {name}] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"chain": name})
        table = common.markdown_table(
            f"Tracing: {TITLES[name]}", results, COLUMNS, ratio_key="us_per_op",
            higher_is_better=False, command=common.command_line(),
            notes=["eager: dispatch + kernel per op (no tracing); jax: jax.make_jaxpr of the "
                   "same loop (jax's tracer), for reference"],
            labels={"jax": "jax tracer (jax.make_jaxpr)"})
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
