"""XLA:CPU compile time of one training-step program: this project's against the pure-jax
step (bench/models_jax.py), in one process, and one MLIR file compiled alone for callgrind.

    PJRT_DEVICE=CPU python bench/bench_compile.py --model mnist --rounds 8 [--write-mlir DIR]
    PJRT_DEVICE=CPU python bench/bench_compile.py --compile-mlir FILE [--parse-only]

The first form traces one step on the xla device (bench/common.traced_step_graph: after two
executed steps, so the optimizer's state exists), lowers it as the executor does
(`build_fn(graph, True, checks=True)`), lowers the pure-jax step of the same model, prints
their StableHLO op histograms and compiles both alternately (`--rounds`, order swapped
every round), each compile from a fresh parse of the module: median wall and CPU seconds
(`time.process_time`, which a loaded machine inflates less). `--write-mlir` keeps both
modules as text.

The second form compiles one module text once with jax's CPU client and nothing else
(no torch, no torch_xla): run it under `valgrind --tool=callgrind` and subtract the
instructions of the same command with `--parse-only` to get the compile's instruction
count, which does not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _compile_text(text: str, parse_only: bool = False):
    """(wall s, CPU s) of one XLA compile of a StableHLO module text."""
    import jax
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    dev = jax.devices()[0]
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        if parse_only:
            return 0.0, 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        compiler.backend_compile_and_load(dev.client, module, xc.DeviceList((dev,)),
                                          compiler.get_compile_options(1, 1), [])
        return time.perf_counter() - t0, time.process_time() - c0


def histogram(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r"^\s*(?:%\S+ = )?([a-z_]+\.[a-z_]+|call)\b", text, re.M))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist", help="mnist, decoder or resnet18")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--write-mlir", metavar="DIR")
    p.add_argument("--compile-mlir", metavar="FILE")
    p.add_argument("--parse-only", action="store_true")
    args = p.parse_args(argv)
    if args.compile_mlir:
        with open(args.compile_mlir) as f:
            wall, cpu = _compile_text(f.read(), args.parse_only)
        print(f"compile s: wall {wall:.3f} CPU {cpu:.3f}")
        return
    import jax
    import torch
    import common
    import models_jax
    import models_torch
    from torch_xla._engine.executor.lower import build_fn

    torch.set_num_threads(2)
    wl = models_torch.workload(args.model)
    graph, params = common.traced_step_graph(wl)
    texts = {"torch-xla-jax": jax.jit(build_fn(graph, True, checks=True), keep_unused=True)
             .lower(*params).as_text()}
    torch.manual_seed(0)
    step, jp, jo, jb = models_jax.make_train_step(wl, wl.make_model())
    x, y = wl.make_batch(0)
    texts["pure jax"] = step.lower(jp, jo, jb, models_jax.to_jax(x), models_jax.to_jax(y)).as_text()
    if args.write_mlir:
        os.makedirs(args.write_mlir, exist_ok=True)
        for name, t in texts.items():
            with open(os.path.join(args.write_mlir, f"{args.model}.{name.replace(' ', '_')}.mlir"), "w") as f:
                f.write(t)
    hists = {k: histogram(t) for k, t in texts.items()}
    names = list(texts)
    print(f"`PJRT_DEVICE=CPU python bench/bench_compile.py --model {args.model} --rounds {args.rounds}`\n")
    print("| StableHLO op | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    print("| all | " + " | ".join(str(sum(hists[n].values())) for n in names) + " |")
    for op, _ in (hists[names[0]] + hists[names[1]]).most_common(12):
        print(f"| {op} | " + " | ".join(str(hists[n][op]) for n in names) + " |")
    res = {n: [] for n in names}
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            res[n].append(_compile_text(texts[n]))
    print("\n| program | compile wall s, median (min-max) | compile CPU s, median (min-max) |\n|---|---|---|")
    for n, v in res.items():
        w, c = [a for a, _ in v], [b for _, b in v]
        print(f"| {n} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) | "
              f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f}) |")


if __name__ == "__main__":
    main()
