"""Interleaved A/B of two source trees of this project with the same venv: the tracing
chains and MNIST / decoder training, to show a change moved nothing beyond noise.

    PJRT_DEVICE=CPU python bench/bench_ab.py --base /tmp/base [--new .] [--rounds 5]
        [--only tracing,mnist,decoder] [--quick] [--out FILE.md]

Each measurement is one fresh subprocess running the xla worker of `bench_tracing.py` or
`bench_training.py` (imported from this tree's bench/, their own schedules) with a
PYTHONPATH that starts with the tree under test. The child checks that `torch_xla.__file__`
lies in that tree before measuring (the venv's editable install points at /work/main) and
reports it; the parent checks it again. Rounds alternate the order (A B, B A, A B, ...).
Reported per measure: median of each side over the rounds, new/base ratio, min-max spread.
`--only` takes tracing (= add,mm_chain), add, mm_chain, mnist, decoder.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

# name: (bench module, its worker args, [(result key, what it is)])
METRICS = {
    "add": ("bench_tracing", {"chain": "add"}, [("cpu_us_per_op", "tracing us/op, CPU time")]),
    "mm_chain": ("bench_tracing", {"chain": "mm_chain"},
                 [("cpu_us_per_op", "tracing us/op, CPU time")]),
    "mnist": ("bench_training", {"model": "mnist"},
              [("step_ms", "training step ms"), ("samples_s", "samples/s (higher is better)"),
               ("compile_s", "compile s, all programs of the run"), ("first_step_s", "first step s")]),
    "decoder": ("bench_training", {"model": "decoder"}, [("step_ms", "training step ms")]),
}
GROUPS = {"tracing": ["add", "mm_chain"]}
# results that must not differ between the trees (same seeds, same programs)
NUMBERS = ("checksum", "first_loss", "last_loss")


def _in_tree(path: str, tree: str) -> bool:
    return os.path.realpath(path).startswith(os.path.join(os.path.realpath(tree), "torch_xla") + os.sep)


def child(args) -> None:
    """Worker side: torch_xla must come from the tree under test, then the bench's own worker."""
    wa = json.loads(args.worker_args)
    module, tree = wa.pop("module"), wa.pop("tree")
    import torch_xla
    where = torch_xla.__file__
    print(f"torch_xla.__file__ = {where}", file=sys.stderr, flush=True)
    if not _in_tree(where, tree):
        sys.exit(f"FATAL: torch_xla imported from {where}, not from the tree under test {tree}")
    emit = common.emit   # tag the worker's one result line with where torch_xla came from
    common.emit = lambda r: emit(dict(r, torch_xla_file=where))
    importlib.import_module(module).main(
        ["--worker", "xla", "--worker-args", json.dumps(wa)] + ["--quick"] * args.quick)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    return f"{names[0]} x{len(names)}" if names else "unknown CPU"


def _commit(tree: str) -> str:
    p = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return f" (HEAD {p.stdout.strip()})" if p.returncode == 0 else ""


def measure(name, trees, args) -> tuple:
    module, worker_args, keys = METRICS[name]
    runs = {"base": [], "new": []}
    for r in range(args.rounds):
        for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
            common.compile_bytecode(trees[side])
            res = common.run_worker(os.path.abspath(__file__), "xla", args,
                                    dict(worker_args, module=module, tree=trees[side]),
                                    extra_env={"PYTHONPATH": trees[side]})
            if res.get("error"):
                sys.exit(f"FAILED {name} {side} ({trees[side]}): {res['error']}")
            if not _in_tree(res["torch_xla_file"], trees[side]):
                sys.exit(f"FATAL: {side} ran torch_xla from {res['torch_xla_file']}")
            print(f"[ab {name}] round {r + 1}/{args.rounds} {side}: {res['wall_s']:.0f} s, "
                  f"torch_xla from {res['torch_xla_file']}", file=sys.stderr, flush=True)
            runs[side].append(res)
    rows = []
    for key, what in keys:
        a, b = ([x[key] for x in runs[s]] for s in ("base", "new"))
        ma, mb = common.median(a), common.median(b)
        rows.append(f"| {name} | {what} | {common.fmt(ma)} ({common.fmt(min(a))}-{common.fmt(max(a))}) "
                    f"| {common.fmt(mb)} ({common.fmt(min(b))}-{common.fmt(max(b))}) | {mb / ma:.3f} |")
    notes = []
    same = {s: {json.dumps([x.get(k) for k in NUMBERS]) for x in runs[s]} for s in runs}
    if same["base"] != same["new"]:
        notes.append(f"{name}: results differ between the trees: base {same['base']}, new {same['new']}")
    for s, rs in runs.items():
        bad = [x for x in rs if x.get("compiles_after_warmup") or x.get("fallback_ops")]
        if bad:
            notes.append(f"{name} {s}: compilations after warm-up or CPU fallbacks: "
                         f"{[(x.get('compiles_after_warmup'), x.get('fallback_ops')) for x in bad]}")
    return rows, notes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="baseline source tree (A)")
    p.add_argument("--new", default=os.path.dirname(HERE), help="tree under test (B)")
    p.add_argument("--rounds", type=int, default=None, help="runs per side (5; 3 with --quick)")
    p.add_argument("--only", default="tracing,mnist,decoder")
    p.add_argument("--quick", action="store_true", help="tiny sizes and schedules (smoke test)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-run timeout, s")
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-args", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return child(args)
    if not args.base:
        p.error("--base is required")
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.original_venv = None   # for common.run_worker
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    names = [n for g in args.only.split(",") for n in GROUPS.get(g, [g])]
    for n in names:
        if n not in METRICS:
            p.error(f"--only: unknown {n!r} (known: tracing, {', '.join(METRICS)})")
    t0, rows, notes = time.time(), [], []
    for n in names:
        r, nt = measure(n, trees, args)
        rows += r
        notes += nt
    lines = [f"`{common.command_line()}`", "",
             f"{time.strftime('%Y-%m-%d %H:%M')}, {_cpu_model()}, interleaved rounds: {args.rounds}"
             f"{' (quick sizes)' if args.quick else ''}, {time.time() - t0:.0f} s; "
             f"base = {trees['base']}{_commit(trees['base'])}, "
             f"new = {trees['new']}{_commit(trees['new'])}", "",
             "| measure | metric | base: median (min-max) | new: median (min-max) | new / base |",
             "| --- | --- | --- | --- | --- |"] + rows
    lines += [""] + [f"- {n}" for n in notes] if notes else []
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
