"""FSDP vs DDP: the decoder trained on 2 processes, step time and per-process peak memory.

    PJRT_DEVICE=CPU python bench/bench_fsdp.py [--steps N] [--quick] [--wide] [--modes ddp,fsdp]

Each mode is a fresh `torch_xla.launch` job of 2 processes (global batch 16 x 512, 8 per
process). ddp: whole model and Adam state on every process, gradients all-reduced
(`xm.optimizer_step`). fsdp: each decoder layer and the whole model wrapped in
XlaFullyShardedDataParallel (transformer_auto_wrap_policy), Adam on the shards; fsdp_keep:
the same with reshard_after_forward=False. Reported
per process: median step time after warm-up (each step waits for the device), peak RSS
(VmHWM) and the bytes of parameters + gradients + optimizer state it holds. --wide: a
weight-heavy decoder (hidden 1024, intermediate 4096, 4 layers, vocab 8000, global batch
4 x 128) where the model state, not the activations, dominates memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _workload(quick: bool, wide: bool):
    import models_torch as mt
    if wide:
        cfg = mt.DecoderConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=8000, max_seq=128)
        return mt.decoder_workload(4, 128, cfg)
    return mt.workload("decoder", quick)


def _job(index: int, mode: str, steps: int, quick: bool, out: str, wide: bool = False) -> None:
    import functools

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    import common
    import models_torch as mt

    wl = _workload(quick, wide)
    n, r = xr.world_size(), xr.global_ordinal()
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model()
    if mode.startswith("fsdp"):
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        model = FSDP(model, reshard_after_forward=mode != "fsdp_keep",
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls={mt.DecoderLayer}))
    else:
        model = model.to(dev)
        xm.broadcast_master_param(model)
    opt = wl.make_opt(model.parameters())
    ids, labels = wl.make_batch(0)
    per = ids.shape[0] // n
    ids, labels = ids[per * r:per * (r + 1)].to(dev), labels[per * r:per * (r + 1)].to(dev)
    times, loss = [], None
    for i in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = wl.loss_fn(model, ids, labels)
        loss.backward()
        if mode.startswith("fsdp"):
            opt.step()
        else:
            xm.optimizer_step(opt)
        xm.mark_step()
        xm.wait_device_ops()
        times.append(time.perf_counter() - t0)
    held = _bytes(list(model.parameters()) + [p.grad for p in model.parameters()]
                  + [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
    res = {"mode": mode, "rank": r, "step_s": common.median(times[max(2, steps // 3):]),
           "peak_rss_mb": common.peak_rss_mb(), "held_mb": held / 2**20, "loss": float(loss.item())}
    with open(f"{out}.{r}", "w") as f:
        json.dump(res, f)


def _worker(mode: str, steps: int, quick: bool, wide: bool) -> None:
    import torch_xla
    out = f"/tmp/bench_fsdp_{os.getpid()}"
    torch_xla.launch(_job, args=(mode, steps, quick, out, wide))
    res = []
    for r in range(2):
        with open(f"{out}.{r}") as f:
            res.append(json.load(f))
        os.unlink(f"{out}.{r}")
    print("RESULT " + json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--modes", default="ddp,fsdp")
    ap.add_argument("--worker", default=None)
    a = ap.parse_args()
    if a.worker:
        _worker(a.worker, a.steps, a.quick, a.wide)
        return
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    rows = []
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, "--steps", str(a.steps)] + (["--quick"] if a.quick else []) + (["--wide"] if a.wide else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise SystemExit(f"{mode} failed")
        rows.extend(json.loads(line[-1][7:]))
    print("| mode | rank | step s (median) | peak RSS MiB | params+grads+optimizer state MiB | loss at last step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for x in rows:
        print(f"| {x['mode']} | {x['rank']} | {x['step_s']:.3f} | {x['peak_rss_mb']:.0f} | {x['held_mb']:.1f} | "
              f"{x['loss']:.4f} |")


if __name__ == "__main__":
    main()
