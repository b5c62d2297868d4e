"""masked_select of a different mask at every step, then reductions over the selection:
programs compiled and time per step with and without `XLA_EXPERIMENTAL` (bounded dynamic
shapes, docs/dynamic_shapes.md). Each side runs in a fresh process (the switch is read
at import).

    PJRT_DEVICE=CPU python bench/bench_bounded_dynamic.py [--steps 40] [--n 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(steps: int, n: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    v = torch.randn(n, generator=torch.Generator().manual_seed(0))
    vd = v.to(dev)
    thresholds = torch.linspace(-1.5, 1.5, steps)
    masks = [(v > t).to(dev) for t in thresholds]
    xm.mark_step()
    met.clear_all()
    t0 = time.perf_counter()
    worst = 0.0
    for t, m in zip(thresholds, masks):
        sel = torch.masked_select(vd, m)
        total, mean = sel.sum(), sel.mean()
        xm.mark_step()
        ref = torch.masked_select(v, v > t)
        worst = max(worst, abs(total.item() - ref.sum().item()), abs(mean.item() - ref.mean().item()))
    secs = time.perf_counter() - t0
    ct = met.metric_data("CompileTime")
    return {"compiles": ct[0] if ct else 0, "ms_per_step": 1e3 * secs / steps, "max_abs_err": worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--worker", action="store_true")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.steps, a.n)))
        return
    for label, switch in (("host read (default)", ""), ("bounded (XLA_EXPERIMENTAL)", "nonzero:masked_select")):
        env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), XLA_EXPERIMENTAL=switch)
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(a.steps),
                            "--n", str(a.n)], env=env, capture_output=True, text=True, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{label:28s} compiles {r['compiles']:3d}  {r['ms_per_step']:8.2f} ms/step  "
              f"max |err| {r['max_abs_err']:.2e}")


if __name__ == "__main__":
    main()
