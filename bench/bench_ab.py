"""Interleaved A/B of two source trees of this project with the same venv: the tracing
chains and MNIST / decoder training, to show a change moved nothing beyond noise.

    PJRT_DEVICE=CPU python bench/bench_ab.py --base /tmp/base [--new .] [--rounds 5]
                                             [--only add,mm_chain,mnist,decoder] [--quick]

Each measurement is one fresh subprocess of `bench_tracing.py` / `bench_training.py`'s
xla worker (this tree's bench code) whose PYTHONPATH starts with the tree under test;
the worker's `torch_xla.__file__` is checked to come from that tree. Rounds alternate
the order (A B, B A, ...). Reported: median of each side over rounds, ratio new/base
(below 1 is faster for times), and the min-max spread.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (script, worker args, result key, unit)
METRICS = {
    "add": ("bench_tracing.py", {"chain": "add"}, "cpu_us_per_op", "us/op (CPU time)"),
    "mm_chain": ("bench_tracing.py", {"chain": "mm_chain"}, "cpu_us_per_op", "us/op (CPU time)"),
    "mnist": ("bench_training.py", {"model": "mnist"}, "step_ms", "step ms"),
    "decoder": ("bench_training.py", {"model": "decoder"}, "step_ms", "step ms"),
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _check_origin(tree: str) -> None:
    import subprocess
    env = dict(os.environ, PYTHONPATH=tree, PJRT_DEVICE="CPU")
    out = subprocess.run([sys.executable, "-c", "import torch_xla; print(torch_xla.__file__)"],
                         capture_output=True, text=True, env=env, cwd="/tmp", timeout=300)
    where = out.stdout.strip()
    if out.returncode != 0 or not where.startswith(os.path.join(tree, "torch_xla")):
        sys.exit(f"torch_xla for {tree} resolves to {where!r} ({out.stderr[-500:]})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True)
    p.add_argument("--new", default=os.path.dirname(HERE))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default=",".join(METRICS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    trees = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    for t in trees.values():
        _check_origin(t)
    wargs = argparse.Namespace(quick=args.quick, original_venv=None, timeout=args.timeout)
    rows = []
    for name in args.only.split(","):
        script, worker_args, key, unit = METRICS[name]
        vals = {"base": [], "new": []}
        for r in range(args.rounds):
            for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                print(f"[ab {name}] {side} round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                res = common.run_worker(os.path.join(HERE, script), "xla", wargs, worker_args,
                                        extra_env={"PYTHONPATH": trees[side]})
                if res.get("error"):
                    sys.exit(f"{name} {side}: {res['error']}")
                vals[side].append(res[key])
        mb, mn = common.median(vals["base"]), common.median(vals["new"])
        rows.append(f"| {name} | {unit} | {mb:.3f} ({min(vals['base']):.3f}-{max(vals['base']):.3f}) | "
                    f"{mn:.3f} ({min(vals['new']):.3f}-{max(vals['new']):.3f}) | {mn / mb:.3f} |")
    lines = [f"`{common.command_line()}` ({time.strftime('%Y-%m-%d %H:%M')}, {_cpu_model()}, "
             f"{args.rounds} interleaved rounds)", "",
             "| measure | unit | base: median (min-max) | new: median (min-max) | new / base |",
             "| --- | --- | --- | --- | --- |"] + rows
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
