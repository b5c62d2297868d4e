"""The cost of the device-side index checks: a training step with embedding + cross-entropy.

    PJRT_DEVICE=CPU python bench/bench_index_checks.py [--quick] [--rounds N]

The decoder-only transformer of bench_training.py (token embedding, cross-entropy over
the vocabulary: the checks of `aten::embedding` and `aten::nll_loss_forward` run in
every step's program) trains in two fresh subprocesses, `XLA_CHECK_INDICES=1` (the
default) and `XLA_CHECK_INDICES=0`: warm-up, then `rounds` rounds of 2 steps each
ending with a host read of the loss. Step time = median over rounds of round time / 2.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

STEPS = 2


def worker(quick: bool, rounds: int):
    import models_torch
    import torch_xla.core.xla_model as xm
    common.set_threads()
    wl = models_torch.workload("decoder", quick=quick)
    step = common.xla_training_step(wl)
    for _ in range(3):
        step()
    xm.wait_device_ops()
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(STEPS):
            loss = step()
        loss.item()
        times.append((common.now() - t0) / STEPS)
    return {"step_ms": common.median(times) * 1e3, "loss": loss.item()}


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if args.worker:
        common.emit(worker(args.quick, 3 if args.quick else args.rounds))
        return
    res = {}
    for name, flag in (("checks on", "1"), ("checks off", "0")):
        print(f"[index checks] {name} ...", file=sys.stderr, flush=True)
        res[name] = common.run_worker(__file__, "xla", args, {}, extra_env={"XLA_CHECK_INDICES": flag})
    for name, r in res.items():
        if "error" in r:
            raise SystemExit(f"{name}: {r['error']}")
    on, off = res["checks on"]["step_ms"], res["checks off"]["step_ms"]
    print(f"command: {common.command_line()}")
    print("| decoder training step | median step ms | loss after the run |")
    print("| --- | --- | --- |")
    for name, r in res.items():
        print(f"| {name} | {r['step_ms']:.1f} | {r['loss']:.4f} |")
    print(f"\nratio on/off: {on / off:.3f}")


if __name__ == "__main__":
    main()
