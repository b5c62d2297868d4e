"""Runs every benchmark and prints one markdown table per benchmark (medians, ratios vs each
contender, and the command that reproduces the table).

    PJRT_DEVICE=CPU python bench/run_all.py [--quick] [--original-venv PATH] [--out FILE]
                                            [--only training,inference,tracing,cache,memory]

--quick shrinks every size and step count so the whole suite is a smoke test of a few
minutes; the figures of BENCHMARKS.md come from a full run on an idle machine.
--out FILE also writes the tables (with a header naming the machine) to FILE.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)

SUITE = [
    ("training", "bench_training.py"),
    ("inference", "bench_inference.py"),
    ("tracing", "bench_tracing.py"),
    ("cache", "bench_cache.py"),
    ("first_step", "bench_first_step.py"),
    ("memory", "bench_memory.py"),
]


def _machine():
    try:
        import torch
        tv = torch.__version__
    except Exception:
        tv = "?"
    try:
        import jax
        jv = jax.__version__
    except Exception:
        jv = "?"
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2 ** 20
    load = os.getloadavg()
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, Python "
            f"{platform.python_version()}, torch {tv}, jax {jv}; load average at start "
            f"{load[0]:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--original-venv", default=None)
    p.add_argument("--only", default=",".join(n for n, _ in SUITE))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    cmd_all = "PJRT_DEVICE=CPU python bench/run_all.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    header = [f"## Benchmark run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
              f"Command: `{cmd_all.strip()}`", "", f"Machine: {_machine()}", ""]
    print("\n".join(header), flush=True)
    chunks = ["\n".join(header)]
    env = dict(os.environ, PJRT_DEVICE="CPU")
    failed = []
    t_all = time.time()
    for name, script in SUITE:
        if name not in args.only.split(","):
            continue
        cmd = [sys.executable, os.path.join(BENCH_DIR, script)]
        if args.quick:
            cmd.append("--quick")
        if args.original_venv:
            cmd += ["--original-venv", args.original_venv]
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_DIR)
        lines = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
        rc = proc.wait()
        if rc != 0:
            failed.append(name)
            lines.append(f"\n**{script} exited with status {rc}**\n")
        print(f"[{name}: {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)
        chunks.append("".join(lines))
    print(f"[suite: {time.time() - t_all:.0f} s]", file=sys.stderr, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(chunks))
    if failed:
        print("FAILED: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
