"""Tracing cost: microseconds per traced op, host side (the Python loop only, timed before
the barrier).

    PJRT_DEVICE=CPU python bench/bench_tracing.py [--quick] [--original-venv PATH]

Chains (64x64 float32):
  add      1000 x `z = z + y`                              (1000 ops)
  mm_chain 250 x `z = relu(z @ y * 0.5 + 1.0)`             (1000 ops)

xla contenders: the loop records the graph (timed), then xm.mark_step() compiles/executes
it (not timed in us/op; reported as "barrier ms"). One warm-up repetition first, so the
graph is compiled and every later repetition must hit the compile cache.
Two clocks: wall time, and the CPU time of the tracing thread (`time.thread_time`), which
a shared, noisy machine disturbs less (both front ends trace on the calling thread only).
The ratio is taken on CPU time. `--rounds N` runs the contenders N times, interleaved
(A, B, A, B, ...), and reports the median over every repetition of every round.
For reference: eager torch runs each op (us/op = dispatch + kernel), and jax's tracer
(jax.make_jaxpr of the same Python loop) is the cost of tracing the chain in jax.
"""
from __future__ import annotations

import os
import sys
import time

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
    trace_us, cpu_us, barrier_ms = [], [], []
    c0 = None
    for i in range(reps + 1):
        z = z0.to(dev)
        xm.mark_step()
        xm.wait_device_ops()
        t0, c0_ = common.now(), time.thread_time()
        z = run(z, y, n)
        t1, c1_ = common.now(), time.thread_time()
        xm.mark_step()
        xm.wait_device_ops()
        t2 = common.now()
        if i == 0:
            c0, _ = stats.snapshot()
            continue
        trace_us.append((t1 - t0) / (n * ops) * 1e6)
        cpu_us.append((c1_ - c0_) / (n * ops) * 1e6)
        barrier_ms.append((t2 - t1) * 1e3)
    c1, ctime = stats.snapshot()
    return {"us_per_op": common.median(trace_us), "cpu_us_per_op": common.median(cpu_us),
            "samples": trace_us, "cpu_samples": cpu_us, "barrier_ms": common.median(barrier_ms),
            "compiles": c1, "compile_s": ctime, "compiles_after_warmup": c1 - c0,
            "fallback_ops": stats.fallback_ops(), "checksum": float(z.cpu().mean())}


def worker_eager(name, reps, n, ops):
    import torch
    common.set_threads()
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(64, 64, generator=g) / 64)
    z0 = torch.rand(64, 64, generator=g)
    run = chain_fn(name, torch.relu)
    times, cpu = [], []
    for i in range(reps + 1):
        t0, c0 = common.now(), time.thread_time()
        z = run(z0.clone(), y, n)
        if i:
            times.append((common.now() - t0) / (n * ops) * 1e6)
            cpu.append((time.thread_time() - c0) / (n * ops) * 1e6)
    return {"us_per_op": common.median(times), "cpu_us_per_op": common.median(cpu),
            "samples": times, "cpu_samples": cpu, "checksum": float(z.mean())}


def worker_jax(name, reps, n, ops):
    import jax
    import jax.numpy as jnp
    import numpy as np
    common.set_threads()
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.random((64, 64), dtype=np.float32) / 64)
    z0 = jnp.asarray(rng.random((64, 64), dtype=np.float32))
    run = chain_fn(name, jax.nn.relu)
    times, cpu = [], []
    for i in range(reps + 1):
        t0, c0 = common.now(), time.thread_time()
        jax.make_jaxpr(lambda z, y: run(z, y, n))(z0, y)
        if i:
            times.append((common.now() - t0) / (n * ops) * 1e6)
            cpu.append((time.thread_time() - c0) / (n * ops) * 1e6)
    return {"us_per_op": common.median(times), "cpu_us_per_op": common.median(cpu),
            "samples": times, "cpu_samples": cpu}


WORKERS = {"xla": worker_xla, "eager": worker_eager, "jax": worker_jax}


def run_worker_main(args):
    wa = common.parse_worker_args(args)
    name = wa["chain"]
    n, ops = CHAINS[name]
    reps = 3 if args.quick else 10
    common.emit(WORKERS[args.worker](name, reps, n, ops))


COLUMNS = [("cpu_us_per_op", "CPU us per traced op (median)"),
           ("us_per_op", "wall us per traced op (median)"), ("barrier_ms", "barrier ms"),
           ("compiles", "compiles"), ("compile_s", "compile s"),
           ("compiles_after_warmup", "compiles after warm-up"), ("peak_rss_mb", "peak RSS MiB")]

TITLES = {"add": "1000 x `z = z + y` (64x64 f32)",
          "mm_chain": "250 x `relu(z @ y * 0.5 + 1.0)` (1000 ops)"}


def _merge_rounds(rs):
    """One result from several runs of a contender: medians over all their repetitions."""
    ok = [r for r in rs if not r.get("error")]
    if not ok:
        return rs[0]
    merged = dict(ok[-1])
    for key, samples in (("us_per_op", "samples"), ("cpu_us_per_op", "cpu_samples")):
        merged[key] = common.median([x for r in ok for x in r.get(samples, [])])
        merged.pop(samples, None)
    if "barrier_ms" in merged:
        merged["barrier_ms"] = common.median([r["barrier_ms"] for r in ok])
    merged["compiles_after_warmup"] = max(r.get("compiles_after_warmup", 0) for r in ok)
    if len(ok) < len(rs):
        merged["error"] = next(r["error"] for r in rs if r.get("error"))
    return merged


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--chains", default="add,mm_chain")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of each contender")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    for name in args.chains.split(","):
        rounds = {c: [] for c in common.contenders_of(args)}
        for r in range(args.rounds):
            for c in rounds:
                print(f"[tracing {name}] {c} round {r + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
                rounds[c].append(common.run_worker(__file__, c, args, {"chain": name}))
        results = {c: _merge_rounds(rs) for c, rs in rounds.items()}
        table = common.markdown_table(
            f"Tracing: {TITLES[name]}", results, COLUMNS, ratio_key="cpu_us_per_op",
            higher_is_better=False, command=common.command_line(),
            notes=["eager: dispatch + kernel per op (no tracing); jax: jax.make_jaxpr of the "
                   "same loop (jax's tracer), for reference"],
            labels={"jax": "jax tracer (jax.make_jaxpr)"})
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
