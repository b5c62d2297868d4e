"""Persistent compilation cache: time from process start to the end of the first training
step, in a first fresh process (empty cache) and a second fresh process (warm cache).

    PJRT_DEVICE=CPU python bench/bench_cache.py [--quick] [--models mnist,decoder]
                                                [--original-venv PATH]

xla contenders call `xr.initialize_cache(tmpdir)` before anything runs; jax sets
jax_compilation_cache_dir on the same kind of temporary directory. Each contender gets
its own empty directory. The clock starts in the parent just before the subprocess is
launched (so it includes interpreter start and imports) and stops when the first step's
loss has been read on the host. Target: second / first <= 0.25. The table also gives
the same times counted from the end of the imports (torch, torch_xla / jax), which isolates
what the cache can save from interpreter start-up and import time (torch._dynamo, which
torch.optim imports on first use, is counted as an import). Eager torch has no
compilation; its row is the floor (imports + one eager step).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def worker_xla(wl, cache_dir):
    import torch
    import torch_xla  # noqa: F401  (imported before t_ready: it counts as an import)
    import torch_xla.core.xla_model  # noqa: F401
    import torch_xla.runtime as xr
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: count it as an import)
    xr.initialize_cache(cache_dir)
    t_ready = time.time()
    common.set_threads()
    stats = common.XlaCompileStats()
    first_loss = common.xla_training_step(wl)().item()
    t_end = time.time()
    c, cs = stats.snapshot()
    return {"t_end": t_end, "t_ready": t_ready, "first_loss": first_loss, "compiles": c, "compile_s": cs,
            "fallback_ops": stats.fallback_ops()}


def worker_jax(wl, cache_dir):
    import jax
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import torch
    import torch._dynamo  # noqa: F401
    common.set_threads()
    import models_jax as mj
    t_ready = time.time()
    cc = mj.CompileCounter()
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    step, params, opt_state, bufs = mj.make_train_step(wl, model)
    x, y = (mj.to_jax(t) for t in wl.make_batch(0))
    loss = step(params, opt_state, bufs, x, y)[0]
    first_loss = float(loss)
    t_end = time.time()
    return {"t_end": t_end, "t_ready": t_ready, "first_loss": first_loss, "compiles": cc.count,
            "compile_s": cc.total_s}


def worker_eager(wl, cache_dir):
    import torch
    import torch._dynamo  # noqa: F401
    t_ready = time.time()
    common.set_threads()
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    opt = wl.make_opt(model.parameters())
    x, y = wl.make_batch(0)
    opt.zero_grad()
    loss = wl.loss_fn(model, x, y)
    loss.backward()
    opt.step()
    return {"t_end": time.time(), "t_ready": t_ready, "first_loss": loss.item()}


WORKERS = {"xla": worker_xla, "jax": worker_jax, "eager": worker_eager}


def run_worker_main(args):
    import models_torch
    wa = common.parse_worker_args(args)
    wl = models_torch.workload(wa["model"], quick=args.quick)
    r = WORKERS[args.worker](wl, wa["cache_dir"])
    r["process_start"] = common.process_start_time()
    common.emit(r)


COLUMNS = [("first_s", "1st process: start to first step s"),
           ("second_s", "2nd process (warm cache) s"), ("ratio", "2nd / 1st"),
           ("pass", "<= 0.25"), ("compiles_1", "compiles 1st"), ("compile_s_1", "compile s 1st"),
           ("compiles_2", "compiles 2nd"), ("compile_s_2", "compile s 2nd"),
           ("ai_1", "1st: imports done to first step s"), ("ai_2", "2nd: same s"),
           ("ai_ratio", "2nd / 1st after imports"), ("cache_mb", "cache MiB")]


def _dir_mb(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total / 2 ** 20


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="default: mnist,decoder (quick: mnist)")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    models = args.models or ("mnist" if args.quick else "mnist,decoder")
    out = []
    for name in models.split(","):
        results = {}
        for c in common.contenders_of(args):
            cache_dir = tempfile.mkdtemp(prefix=f"bench-cache-{c}-")
            runs = []
            try:
                for i in (1, 2):
                    print(f"[cache {name}] {c} process {i} ...", file=sys.stderr, flush=True)
                    r = common.run_worker(__file__, c, args, {"model": name, "cache_dir": cache_dir})
                    if "t_end" in r:
                        r["first_step_wall_s"] = r["t_end"] - r["t_launch"]
                        r["after_imports_s"] = r["t_end"] - r["t_ready"]
                    runs.append(r)
                size = _dir_mb(cache_dir)
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            r1, r2 = runs
            row = {"error": r1.get("error") or r2.get("error"), "cache_mb": size,
                   "first_s": r1.get("first_step_wall_s"), "second_s": r2.get("first_step_wall_s"),
                   "compiles_1": r1.get("compiles"), "compile_s_1": r1.get("compile_s"),
                   "compiles_2": r2.get("compiles"), "compile_s_2": r2.get("compile_s"),
                   "fallback_ops": r1.get("fallback_ops"),
                   "ai_1": r1.get("after_imports_s"), "ai_2": r2.get("after_imports_s")}
            if row["ai_1"] and row["ai_2"]:
                row["ai_ratio"] = row["ai_2"] / row["ai_1"]
            if row["first_s"] and row["second_s"]:
                row["ratio"] = row["second_s"] / row["first_s"]
                if c != "eager":
                    row["pass"] = row["ratio"] <= 0.25
            if row["error"] is None:
                del row["error"]
            results[c] = row
        table = common.markdown_table(
            f"Persistent cache, first training step: {name}" + (" (quick sizes)" if args.quick else ""),
            results, COLUMNS, command=common.command_line(),
            notes=["eager torch compiles nothing: its row is the floor (interpreter start, "
                   "imports, one eager step), not a cache test"])
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
