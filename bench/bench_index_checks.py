"""The cost of the device-side checks: index ranges and integer divisors.

    PJRT_DEVICE=CPU python bench/bench_index_checks.py [--quick] [--rounds N] [--workloads decoder,division]

Each workload runs in two fresh subprocesses, `XLA_CHECK_INDICES=1` (the default) and
`XLA_CHECK_INDICES=0`: warm-up, then `rounds` rounds of 2 steps each ending with a host
read. Step time = median over rounds of round time / 2.

- `decoder`: the decoder-only transformer of bench_training.py trains (token embedding,
  cross-entropy over the vocabulary: the checks of `aten::embedding` and
  `aten::nll_loss_forward` run in every step's program).
- `division`: integer division with tensor divisors, the worst case for the divisor
  checks (a program of elementwise ops only, each division checked over all its
  divisors): 2^22 int64 ids (2^18 with --quick) advance by a Lehmer generator
  (`ids * 48271 % (2^31 - 1)`), then `ids // sizes + ids % sizes` with per-element
  divisors `sizes`, summed.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

STEPS = 2
WORKLOADS = ("decoder", "division")


def _decoder_step(quick: bool):
    import models_torch
    wl = models_torch.workload("decoder", quick=quick)
    step = common.xla_training_step(wl)
    return step, lambda loss: loss.item()


def _division_step(quick: bool):
    import torch
    import torch_xla.core.xla_model as xm
    n = 1 << (18 if quick else 22)
    g = torch.Generator().manual_seed(0)
    state = {"ids": torch.randint(1, 2 ** 31 - 1, (n,), generator=g).to("xla")}
    sizes = torch.randint(1, 1000, (n,), generator=g).to("xla")

    def step():
        ids = state["ids"] = state["ids"] * 48271 % (2 ** 31 - 1)
        out = (ids // sizes + ids % sizes).sum()
        xm.mark_step()
        return out
    return step, lambda out: int(out.item())


def worker(workload: str, quick: bool, rounds: int):
    import torch_xla.core.xla_model as xm
    common.set_threads()
    step, read = (_decoder_step if workload == "decoder" else _division_step)(quick)
    for _ in range(3):
        step()
    xm.wait_device_ops()
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(STEPS):
            out = step()
        read(out)
        times.append((common.now() - t0) / STEPS)
    return {"step_ms": common.median(times) * 1e3, "result": read(out)}


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    args = p.parse_args(argv)
    if args.worker:
        import json
        wargs = json.loads(args.worker_args)
        common.emit(worker(wargs.get("workload", "decoder"), args.quick, 3 if args.quick else args.rounds))
        return
    workloads = [w for w in args.workloads.split(",") if w in WORKLOADS]
    res = {}
    for wl in workloads:
        for name, flag in (("checks on", "1"), ("checks off", "0")):
            print(f"[checks] {wl}, {name} ...", file=sys.stderr, flush=True)
            res[wl, name] = common.run_worker(__file__, "xla", args, {"workload": wl},
                                              extra_env={"XLA_CHECK_INDICES": flag})
    for key, r in res.items():
        if "error" in r:
            raise SystemExit(f"{key}: {r['error']}")
    print(f"command: {common.command_line()}")
    print("| workload | setting | median step ms | result after the run |")
    print("| --- | --- | --- | --- |")
    for (wl, name), r in res.items():
        v = r["result"]
        print(f"| {wl} | {name} | {r['step_ms']:.1f} | {v:.4f} |" if isinstance(v, float) else
              f"| {wl} | {name} | {r['step_ms']:.1f} | {v} |")
    print()
    for wl in workloads:
        print(f"{wl}: ratio on/off {res[wl, 'checks on']['step_ms'] / res[wl, 'checks off']['step_ms']:.3f}")


if __name__ == "__main__":
    main()
