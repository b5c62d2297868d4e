"""Time to first result: a fresh process's first training steps, tiered compilation on
and off, and the original.

    PJRT_DEVICE=CPU python bench/bench_first_step.py [--quick] [--models mnist,decoder,resnet18]
                                                     [--rounds 3] [--steps 6] [--original-venv PATH]

Each round launches one fresh process per contender (contenders alternate, so the drift of
a shared machine hits them alike). A process imports torch, torch_xla and then torch._dynamo
(torch.optim imports it at its first step: it is counted as an import, as the original
imports it with torch_xla), then times from the end of the imports: building the model
on the device, the first step up to its loss on the host, and every step up to `--steps`
(each read back). Contenders: `once` (this project's default: every program compiled once,
optimized), `tiered` (`XLA_TIERED_COMPILE=1`) and the original. Reports
medians over rounds: first loss, time to the last step's loss, launch to first loss, the
CompileTime metric (count, seconds) and the programs compiled in the background, and
whether every step's loss equals the `once` contender's in the same round (bit for bit).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def worker_xla(wl, steps):
    import torch  # noqa: F401
    import torch_xla  # noqa: F401
    import torch_xla.core.xla_model  # noqa: F401
    # After torch_xla, where a training script meets it (torch.optim's first step).
    import torch._dynamo  # noqa: F401
    t_ready = time.time()
    common.set_threads()
    stats = common.XlaCompileStats()
    step = common.xla_training_step(wl)
    t = [time.time()]
    losses = []
    for _ in range(steps):
        losses.append(step().item())
        t.append(time.time())
    c, cs = stats.snapshot()
    bg = None
    try:
        import torch_xla.debug.metrics as met
        d = met.metric_data("BackgroundCompileTime")
        bg = [d[0], d[1] / 1e9] if d else [0, 0.0]
    except Exception:  # the original has no such metric
        pass
    return {"t_ready": t_ready, "t_model": t[0], "t_steps": t[1:], "losses": losses,
            "compiles": c, "compile_s": cs, "background": bg}


def run_worker_main(args):
    import models_torch
    wa = common.parse_worker_args(args)
    wl = models_torch.workload(wa["model"], quick=args.quick)
    r = worker_xla(wl, wa["steps"])
    r["process_start"] = common.process_start_time()
    common.emit(r)


CONTENDERS = {"once": ("xla", {"XLA_TIERED_COMPILE": "0"}), "tiered": ("xla", {"XLA_TIERED_COMPILE": "1"}),
              "original": ("original", {})}
LABELS = {"once": "torch-xla-jax (default)", "tiered": "torch-xla-jax, XLA_TIERED_COMPILE=1", "original": "torch_xla 2.9 (original)"}
COLUMNS = [("first_s", "imports done to first loss s"), ("last_s", "to last step's loss s"),
           ("launch_first_s", "launch to first loss s"), ("model_s", "model on device s"),
           ("compiles", "compiles"), ("compile_s", "compile s"), ("background", "background compiles (n, s)"),
           ("same", "losses = once's")]


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="mnist,decoder,resnet18")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    names = [c for c in CONTENDERS if c != "original" or args.original_venv]
    out = []
    for model in args.models.split(","):
        runs = {c: [] for c in names}
        same = {c: True for c in names}
        for i in range(args.rounds):
            got = {}
            for c in names:
                kind, env = CONTENDERS[c]
                print(f"[first-step {model}] round {i + 1} {c} ...", file=sys.stderr, flush=True)
                r = common.run_worker(__file__, kind, args, {"model": model, "steps": args.steps}, extra_env=env)
                got[c] = r
                if "error" not in r:
                    runs[c].append(r)
            ref = got.get("once", {}).get("losses")
            for c in names:
                if ref is None or got[c].get("losses") != ref:
                    same[c] = False
        results = {}
        for c in names:
            rs = runs[c]
            if not rs:
                results[c] = {"error": "every round failed"}
                continue
            results[c] = {
                "first_s": common.median([r["t_steps"][0] - r["t_ready"] for r in rs]),
                "last_s": common.median([r["t_steps"][-1] - r["t_ready"] for r in rs]),
                "launch_first_s": common.median([r["t_steps"][0] - r["t_launch"] for r in rs]),
                "model_s": common.median([r["t_model"] - r["t_ready"] for r in rs]),
                "compiles": rs[0]["compiles"], "compile_s": common.median([r["compile_s"] for r in rs]),
                "background": (f"{rs[0]['background'][0]}, {common.median([r['background'][1] for r in rs]):.2f}"
                               if rs[0].get("background") else "-"),
                "same": same[c] if c != "original" else None,
            }
        table = common.markdown_table(
            f"Time to first result: {model}, {args.steps} steps, medians of {args.rounds} rounds"
            + (" (quick sizes)" if args.quick else ""), results, COLUMNS, command=common.command_line(),
            labels=LABELS)
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
