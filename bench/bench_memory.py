"""Memory: (1) no leak: resident memory of a small MLP's training at step 100 vs step 1000
(target: within 5%); (2) peak RSS of decoder training vs eager PyTorch.

    PJRT_DEVICE=CPU python bench/bench_memory.py [--quick] [--original-venv PATH]

Fresh subprocess per contender. RSS is VmRSS / VmHWM from /proc/self/status, read after a
host read of the loss (so pending device work is done). --quick: 10 vs 100 steps, and the
decoder at the quick sizes.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _mlp_workload():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import models_torch

    def make_model():
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                             nn.Linear(128, 10))

    def make_batch(seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
    return models_torch.Workload(
        "mlp", 64, make_model, make_batch, lambda m, x, y: F.cross_entropy(m(x), y),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), "sgd", 0.01, 0.9)


def _train_loop(wl, step_fn, checkpoints, total, read_loss):
    rss = {}
    loss = None
    for i in range(1, total + 1):
        loss = step_fn()
        if i in checkpoints:
            read_loss(loss)
            rss[i] = common.rss_mb()
    return rss, read_loss(loss)


def worker_xla(wl, checkpoints, total):
    common.set_threads()
    stats = common.XlaCompileStats()
    step = common.xla_training_step(wl)
    rss, last = _train_loop(wl, step, checkpoints, total, lambda l: l.item())
    c, cs = stats.snapshot()
    return {"rss": rss, "last_loss": last, "compiles": c, "compile_s": cs,
            "fallback_ops": stats.fallback_ops()}


def worker_eager(wl, checkpoints, total):
    step = common.eager_training_step(wl)
    rss, last = _train_loop(wl, step, checkpoints, total, lambda l: l.item())
    return {"rss": rss, "last_loss": last}


def worker_jax(wl, checkpoints, total):
    import torch
    common.set_threads()
    import models_jax as mj
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    train_step, params, opt_state, bufs = mj.make_train_step(wl, model)
    x, y = (mj.to_jax(t) for t in wl.make_batch(0))
    state = [params, opt_state, bufs]

    def step():
        loss, state[0], state[1], state[2] = train_step(state[0], state[1], state[2], x, y)
        return loss
    rss, last = _train_loop(wl, step, checkpoints, total, float)
    return {"rss": rss, "last_loss": last}


WORKERS = {"xla": worker_xla, "eager": worker_eager, "jax": worker_jax}


def run_worker_main(args):
    import models_torch
    wa = common.parse_worker_args(args)
    if wa["mode"] == "leak":
        if wa.get("model", "mlp") != "mlp":
            raise ValueError(wa["model"])
        wl = _mlp_workload()
        first, last = (10, 100) if args.quick else (100, 1000)
        if args.worker == "jax":
            raise SystemExit("the MLP has no jax version")
        r = WORKERS[args.worker](wl, {first, last}, last)
        r["rss_first"] = r["rss"][first]
        r["rss_last"] = r["rss"][last]
        r["growth_pct"] = (r["rss_last"] / r["rss_first"] - 1.0) * 100.0
        r["pass"] = abs(r["growth_pct"]) <= 5.0
        r["steps"] = f"{first} -> {last}"
    else:
        wl = models_torch.workload("decoder", quick=args.quick)
        n = 3 if args.quick else 5
        r = WORKERS[args.worker](wl, {n}, n)
        r["rss_end"] = r["rss"][n]
        r["steps"] = n
    del r["rss"]
    common.emit(r)


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="leak,peak")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    out = []
    parts = args.parts.split(",")
    if "leak" in parts:
        results = {}
        for c in common.contenders_of(args, ("xla", "eager", "original")):
            print(f"[memory leak] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"mode": "leak"})
        out.append(common.markdown_table(
            "Memory: RSS over training steps (MLP 784-256-128-10, batch 64, SGD momentum)",
            results,
            [("steps", "steps"), ("rss_first", "RSS first MiB"), ("rss_last", "RSS last MiB"),
             ("growth_pct", "growth %"), ("pass", "within 5%"), ("peak_rss_mb", "peak RSS MiB"),
             ("compiles", "compiles")],
            command=common.command_line()))
        print(out[-1], flush=True)
    if "peak" in parts:
        results = {}
        for c in common.contenders_of(args):
            print(f"[memory peak decoder] {c} ...", file=sys.stderr, flush=True)
            results[c] = common.run_worker(__file__, c, args, {"mode": "peak"})
        out.append(common.markdown_table(
            "Memory: peak RSS of decoder training" + (" (quick sizes)" if args.quick else ""),
            results,
            [("steps", "steps"), ("peak_rss_mb", "peak RSS MiB"), ("rss_end", "RSS at end MiB"),
             ("compiles", "compiles"), ("last_loss", "loss last")],
            ratio_key="peak_rss_mb", higher_is_better=False, command=common.command_line(),
            notes=["ratio columns: the other contender's peak RSS / this one's (>1: this one "
                   "uses less)"]))
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    main()
