"""First loss of a fresh process, A/B of environment settings (first-step levers).

    PJRT_DEVICE=CPU python bench/bench_first_loss.py [--models mnist,decoder] [--rounds 4]
        [--variants '{"dynamo_at_step": {"PT_XLA_LAZY_OPTIMIZER_DYNAMO": "0"}}'] [--quick]
        [--original-venv PATH]

Each round launches one fresh process per side (`default`, then each variant, then
`original` with --original-venv: the same worker under PATH/bin/python, torch_xla 2.9; the
order rotating from round to round). A process imports torch and torch_xla only, as a training
script does (nothing imports torch._dynamo for it), then times from the end of the imports:
building the model on the device, the first training step up to its loss on the host, and
the second step. Reports medians over rounds: imports, first loss after the imports (and
the process's CPU time over that span, all threads: steadier than wall time on a loaded
machine), launch to first loss, second step (and its CPU time), whether torch._dynamo was imported by the end,
and whether the two losses equal the default's bit for bit (the original's are its own: printed below the
table). With the original, each side's first loss, its CPU time and launch-to-first-loss are
also given as a ratio to the original's. The load average is printed before and after.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

COLUMNS = [("imports_s", "imports s"), ("first_loss_s", "first loss after imports s"),
           ("first_loss_cpu_s", "its CPU time s"), ("launch_s", "launch to first loss s"),
           ("second_s", "second step s"), ("second_cpu_s", "its CPU time s")]


def worker(args) -> None:
    t_launch = common.process_start_time()
    import torch  # noqa: F401
    import torch_xla  # noqa: F401
    import torch_xla.core.xla_model  # noqa: F401
    t_ready, c_ready = time.time(), time.process_time()
    import models_torch
    common.set_threads()
    wa = common.parse_worker_args(args)
    wl = models_torch.workload(wa["model"], quick=args.quick)
    step = common.xla_training_step(wl)
    first = step().item()
    t_first, c_first = time.time(), time.process_time()
    second = step().item()
    t_second, c_second = time.time(), time.process_time()
    common.emit({"imports_s": t_ready - t_launch, "first_loss_s": t_first - t_ready,
                 "first_loss_cpu_s": c_first - c_ready,
                 "launch_s": t_first - t_launch, "second_s": t_second - t_first,
                 "second_cpu_s": c_second - c_first,
                 "losses": [first, second], "dynamo": "torch._dynamo" in sys.modules})


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="mnist,decoder")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variants", default='{"dynamo_at_step": {"PT_XLA_LAZY_OPTIMIZER_DYNAMO": "0"}}',
                   help="JSON: name -> environment added to the process")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    variants = dict({"default": {}}, **json.loads(args.variants))
    if args.original_venv:
        if "original" in variants:
            p.error("a variant cannot be named 'original'")
        variants["original"] = {}
    sides = list(variants)
    print(f"`{common.command_line()}`\n")
    for name in args.models.split(","):
        runs = {s: [] for s in sides}
        load0, t0 = common.load_average(), time.time()
        for r in range(args.rounds):
            for s in sides[r % len(sides):] + sides[:r % len(sides)]:
                res = common.run_worker(__file__, "original" if s == "original" else "xla", args,
                                        {"model": name}, extra_env=variants[s] or None)
                if res.get("error"):
                    sys.exit(f"{name} {s}: {res['error']}")
                print(f"[first_loss {name}] round {r + 1} {s}: {res['first_loss_s']:.2f} s",
                      file=sys.stderr, flush=True)
                runs[s].append(res)
        print(f"### {name}{' (quick sizes)' if args.quick else ''}\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} rounds, {time.time() - t0:.0f} s; "
              f"load average {load0} before, {common.load_average()} after\n")
        orig = "original" in runs
        head = (["side"] + [h for _, h in COLUMNS] + ["first loss / default's"]
                + (["first loss / original's", "its CPU time / original's", "launch to first loss / original's"]
                   if orig else [])
                + ["torch._dynamo imported", "losses = default's"])
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        med = {s: {k: common.median([x[k] for x in runs[s]]) for k, _ in COLUMNS} for s in sides}
        ref = {json.dumps(x["losses"]) for x in runs["default"]}
        for s in sides:
            row = [s] + [f"{med[s][k]:.2f} ({min(x[k] for x in runs[s]):.2f}-{max(x[k] for x in runs[s]):.2f})"
                         for k, _ in COLUMNS]
            row.append(f"{med[s]['first_loss_s'] / med['default']['first_loss_s']:.2f}")
            if orig:
                row += [f"{med[s][k] / med['original'][k]:.2f}" for k in ("first_loss_s", "first_loss_cpu_s", "launch_s")]
            row.append("/".join(sorted({'yes' if x['dynamo'] else 'no' for x in runs[s]})))
            if s == "original":
                row.append("(its own)")
            else:
                same = {json.dumps(x["losses"]) for x in runs[s]} == ref and len(ref) == 1
                row.append("yes" if same else "NO")
            print("| " + " | ".join(row) + " |")
        if orig:
            print(f"\nLosses (steps 1, 2): default {runs['default'][0]['losses']}, "
                  f"original {runs['original'][0]['losses']}")
        print(flush=True)


if __name__ == "__main__":
    main()
