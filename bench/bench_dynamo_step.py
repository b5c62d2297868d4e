"""A training step through torch.compile(backend='openxla'): the whole step as one XLA
program (the default) vs one program per graph (XLA_DYNAMO_ONE_PROGRAM=0).

    PJRT_DEVICE=CPU python bench/bench_dynamo_step.py [--quick] [--models mnist,decoder]
                                                      [--steps N] [--rounds N]
                                                      [--original-venv PATH]

Each mode runs in its own fresh subprocess (bench/common.py). The model is compiled with
torch.compile (Dynamo gives the bridge a forward graph and a backward graph); the
optimizer (MNIST: SGD with momentum, decoder: Adam) runs its ops lazily; a step is
zero_grad, forward + loss, backward, optimizer step, xm.mark_step(). After warm-up each
measured step is timed twice: host ms (the Python step call, barrier included, no
waiting) and step ms (until `xm.wait_device_ops()` returns); medians over the steps.
Programs per step: `ExecuteTime` samples (one per executed XLA program) over the measured
steps / steps. samples/s = batch / step ms. With --original-venv the same worker runs under
torch_xla 2.9 (`original`: its `openxla` backend, one program per graph). With --rounds N
the modes run N times each, alternating, in fresh processes; the table holds the medians. The decoder is bench/models_torch.py's at
batch 4, sequence 128 (2 layers, hidden 256, vocabulary 3200).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

WARMUP = 3
MODES = ("split", "one_program")
LABELS = {"split": "one program per graph (XLA_DYNAMO_ONE_PROGRAM=0)", "one_program": "one program per step (default)",
          "original": "torch_xla 2.9 openxla (original)"}
COLUMNS = [("programs_per_step", "programs/step"), ("host_ms", "host ms/step"), ("step_ms", "step ms"),
           ("samples_s", "samples/s"), ("compiles_after_warmup", "compiles after warm-up"),
           ("compile_s", "compile s (all)"), ("last_loss", "loss last")]


def _workload(name: str, quick: bool):
    import models_torch
    if name == "decoder" and not quick:
        cfg = models_torch.DecoderConfig(max_seq=128)
        return models_torch.decoder_workload(batch=4, seq=128, cfg=cfg)
    return models_torch.workload(name, quick=quick)


def worker(name: str, quick: bool, steps: int) -> dict:
    common.set_threads()
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def runs() -> int:
        data = met.metric_data("ExecuteTime")
        return int(data[0]) if data else 0

    stats = common.XlaCompileStats()
    wl = _workload(name, quick)
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model().to(dev)
    model.train()
    opt = wl.make_opt(model.parameters())
    cmodel = torch.compile(model, backend="openxla")
    x, y = (t.to(dev) for t in wl.make_batch(0))

    def step():
        opt.zero_grad()
        loss = wl.loss_fn(cmodel, x, y)
        loss.backward()
        opt.step()
        xm.mark_step()
        return loss

    for _ in range(WARMUP):
        step()
    xm.wait_device_ops()
    c0, _ = stats.snapshot()
    r0 = runs()
    host, wall = [], []
    for _ in range(steps):
        t0 = common.now()
        loss = step()
        t1 = common.now()
        xm.wait_device_ops()
        wall.append(common.now() - t0)
        host.append(t1 - t0)
    programs = (runs() - r0) / steps
    c1, compile_s = stats.snapshot()
    step_s = common.median(wall)
    return {"programs_per_step": programs, "host_ms": common.median(host) * 1e3, "step_ms": step_s * 1e3,
            "samples_s": wl.batch / step_s, "compiles_after_warmup": c1 - c0, "compile_s": compile_s,
            "last_loss": float(loss.item()), "batch": wl.batch}


def _medians(rounds: list) -> dict:
    """One result per mode: the median of every numeric field over the rounds that ran."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    out = dict(ok[-1])
    for k, v in ok[-1].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = common.median([r[k] for r in ok])
    return out


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--models", default="mnist,decoder")
    p.add_argument("--steps", type=int, default=10, help="measured steps after warm-up")
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating; medians")
    args = p.parse_args(argv)
    if args.worker:
        w = common.parse_worker_args(args)
        return common.emit(worker(w["model"], args.quick, w["steps"]))
    out = []
    for name in args.models.split(","):
        modes = MODES + (("original",) if args.original_venv else ())
        runs = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes:
                print(f"[dynamo step {name}] {mode} round {r + 1} ...", file=sys.stderr, flush=True)
                env = {"XLA_DYNAMO_ONE_PROGRAM": "1" if mode == "one_program" else "0"}
                contender = "original_split" if mode == "original" else mode
                runs[mode].append(common.run_worker(__file__, contender, args,
                                                    {"model": name, "steps": args.steps}, extra_env=env))
        results = {m: _medians(rs) for m, rs in runs.items()}
        title = f"One XLA program per training step: {name}" + (" (quick sizes)" if args.quick else "")
        table = common.markdown_table(title, results, COLUMNS, ratio_key="samples_s",
                                      command=common.command_line(), labels=LABELS)
        print(table, flush=True)
        out.append(table)
    return out


if __name__ == "__main__":
    main()
