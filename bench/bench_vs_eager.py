"""Training samples/s against what a CPU user would pick instead: eager PyTorch and
`torch.compile` (inductor).

    PJRT_DEVICE=CPU python bench/bench_vs_eager.py [--models mnist,decoder,resnet18]
        [--contenders xla,eager,inductor] [--rounds 3] [--quick]
        [--variants '{"onednn": {"XLA_FLAGS": "--xla_cpu_use_onednn=true"}}']

Workloads (bench/models_torch.py): MNIST CNN batch 128, the decoder at batch 8 x 256, the
ResNet-18 shape at batch 32. Contenders, each run in a fresh process:
  xla       this project: lazy tensors on the xla device, `xm.mark_step()` per step;
  eager     eager PyTorch on the CPU, `torch.set_num_threads(2)`;
  inductor  the model wrapped in `torch.compile` (inductor, default mode), the optimizer
            eager, 2 threads; its compilations happen during the warm-up steps;
  xla:NAME  the xla contender with the environment of `--variants` NAME added (an XLA
            option A/B on whole training steps, each side its own fresh processes).
Every round runs each contender once, in an order that rotates from round to round, so
the drift of a shared machine hits them alike. Reported per workload: median samples/s
over the rounds (min-max), each contender's ratio to eager and to inductor, the load
average before and after, and whether the losses agree (the xla variants' losses must
equal the xla contender's bit for bit).
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# (warmup, rounds of timing, steps per round)
SCHEDULE = {"mnist": (5, 8, 10), "decoder": (3, 5, 3), "resnet18": (3, 5, 3)}
QUICK_SCHEDULE = (3, 3, 2)


def workload(name: str, quick: bool):
    import models_torch as mt
    if quick:
        return mt.workload(name, quick=True)
    if name == "decoder":
        return mt.decoder_workload(batch=8, seq=256)
    return mt.workload(name)


def _timed(step, read, rounds, steps):
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(steps):
            out = step()
        read(out)
        times.append((common.now() - t0) / steps)
    return times


def run_worker_main(args) -> None:
    wa = common.parse_worker_args(args)
    wl = workload(wa["model"], args.quick)
    warmup, rounds, steps = QUICK_SCHEDULE if args.quick else SCHEDULE[wa["model"]]
    stats = None
    if args.worker == "xla":
        import torch_xla.core.xla_model as xm
        common.set_threads()
        stats = common.XlaCompileStats()
        step = common.xla_training_step(wl)
    elif args.worker == "eager":
        step = common.eager_training_step(wl)
    else:
        step = common.eager_training_step(wl, inductor=True)
    t0 = common.now()
    first_loss = step().item()
    first_step_s = common.now() - t0
    for _ in range(warmup - 1):
        step()
    if stats:
        xm.wait_device_ops()
        c0, _ = stats.snapshot()
    times = _timed(step, lambda loss: loss.item(), rounds, steps)
    r = {"first_loss": first_loss, "last_loss": step().item(), "first_step_s": first_step_s,
         "step_ms": common.median(times) * 1e3, "samples_s": wl.batch / common.median(times)}
    if stats:
        c1, ctime = stats.snapshot()
        r.update(compiles=c1, compile_s=ctime, compiles_after_warmup=c1 - c0,
                 fallback_ops=stats.fallback_ops())
    common.emit(r)


def measure(name: str, contenders: list, variants: dict, args) -> str:
    runs = {c: [] for c in contenders}
    load0 = common.load_average()
    t0 = time.time()
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            worker, _, variant = c.partition(":")
            env = dict(variants[variant]) if variant else None
            res = common.run_worker(__file__, worker, args, {"model": name}, extra_env=env)
            print(f"[vs_eager {name}] round {r + 1}/{args.rounds} {c}: "
                  f"{res.get('samples_s', float('nan')):.1f} samples/s, {res['wall_s']:.0f} s"
                  f"{' ERROR ' + res['error'] if res.get('error') else ''}",
                  file=sys.stderr, flush=True)
            runs[c].append(res)
    load1 = common.load_average()
    med = {c: common.median([x["samples_s"] for x in runs[c] if x.get("samples_s")])
           for c in contenders}
    refs = [c for c in ("eager", "inductor") if c in contenders]
    head = ["contender", "samples/s median (min-max)", "step ms", "first step s",
            "peak RSS MiB", "loss step 1 / last"] + [f"/ {c}" for c in refs]
    lines = [f"### {name}" + (" (quick sizes)" if args.quick else ""), "",
             f"`{common.command_line()}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} rounds, {time.time() - t0:.0f} s; "
             f"load average {load0} before, {load1} after", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for c in contenders:
        ok = [x for x in runs[c] if x.get("samples_s")]
        if not ok:
            lines.append(f"| {c} | FAILED |" + " - |" * (len(head) - 2))
            notes.append(f"{c}: {runs[c][0].get('error', '')[:400]}")
            continue
        s = [x["samples_s"] for x in ok]
        row = [c, f"{common.fmt(med[c])} ({common.fmt(min(s))}-{common.fmt(max(s))})",
               common.fmt(common.median([x["step_ms"] for x in ok])),
               common.fmt(common.median([x["first_step_s"] for x in ok])),
               common.fmt(common.median([x["peak_rss_mb"] for x in ok])),
               f"{ok[0]['first_loss']:.6g} / {ok[0]['last_loss']:.6g}"]
        row += [f"{med[c] / med[ref]:.2f}" if med.get(ref) else "-" for ref in refs]
        lines.append("| " + " | ".join(row) + " |")
        if any(x.get("compiles_after_warmup") for x in ok):
            notes.append(f"{c}: compilations after warm-up {[x.get('compiles_after_warmup') for x in ok]}")
        if any(x.get("fallback_ops") for x in ok):
            notes.append(f"{c}: CPU fallbacks {ok[0]['fallback_ops']}")
        if c.startswith("xla:") and runs.get("xla"):
            base = {(x["first_loss"], x["last_loss"]) for x in runs["xla"] if "first_loss" in x}
            mine = {(x["first_loss"], x["last_loss"]) for x in ok}
            notes.append(f"{c}: losses {'equal' if mine == base else 'DIFFER from'} xla's "
                         f"bit for bit ({sorted(mine)} vs {sorted(base)})")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="mnist,decoder,resnet18")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="{}",
                   help="JSON: name -> environment added to the xla contender (contender xla:name)")
    args = p.parse_args(argv)
    if args.worker:
        return run_worker_main(args)
    args.original_venv = None
    variants = json.loads(args.variants)
    contenders = (args.contenders.split(",") if args.contenders
                  else ["xla", "eager", "inductor"]) + [f"xla:{v}" for v in variants
                                                       if not args.contenders]
    for c in contenders:
        w, _, v = c.partition(":")
        if w not in ("xla", "eager", "inductor") or (v and v not in variants):
            p.error(f"unknown contender {c!r}")
    out = []
    for name in args.models.split(","):
        text = measure(name, contenders, variants, args)
        print(text, flush=True)
        out.append(text)
    return out


if __name__ == "__main__":
    main()
