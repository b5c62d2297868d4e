"""SPMD: the decoder trained with FSDPv2 over 4 devices against unsharded programs.

    PJRT_DEVICE=CPU python bench/bench_spmd.py [--quick] [--devices 4]

Contenders, each in a fresh subprocess with CPU_NUM_DEVICES=devices:
- `fsdp`: SPMD, FSDPv2 (parameters and optimizer state sharded over 'fsdp'), batch split
  over the same axis;
- `data`: SPMD, parameters replicated on every device, batch split (data parallel);
- `single`: no SPMD, one device, the whole batch.
Reported: per-device bytes of parameters + optimizer state (the largest device, from
the device buffers' shards), step time (median of rounds, each ended by a host read of
the loss), the process's peak RSS (all "devices" share the host), the first and last loss (equal starts, same data: the runs must agree), and
compilations after warm-up (must be 0). On the CPU the "devices" share two cores, so
step times compare the programs' overhead, not a speed-up.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _per_device_bytes(tensors) -> int:
    from torch_xla._engine.tensor import state_of
    per = {}
    for t in tensors:
        arr = state_of(t).node.array
        for s in arr.addressable_shards:
            per[s.device.id] = per.get(s.device.id, 0) + s.data.nbytes
    return max(per.values())


def worker(contender: str, quick: bool) -> None:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from models_torch import DecoderConfig, decoder_workload

    common.set_threads()
    if contender != "single":
        xr.use_spmd()
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
    cfg = DecoderConfig(hidden_size=128, intermediate_size=512, vocab_size=1024, max_seq=64) if quick else \
        DecoderConfig(max_seq=128)
    wl = decoder_workload(batch=8 if quick else 16, seq=cfg.max_seq, cfg=cfg)
    torch.manual_seed(0)
    model = wl.make_model().to("xla")
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model")) if contender != "single" else None
    if contender == "fsdp":
        model = FSDPv2(model, mesh, shard_output=lambda out, m: None)
    opt = wl.make_opt(model.parameters())
    ids, labels = wl.make_batch(0)

    def step():
        x, y = ids.to("xla"), labels.to("xla")
        if mesh is not None:
            xs.mark_sharding(x, mesh, ("fsdp", None))
            xs.mark_sharding(y, mesh, ("fsdp", None))
        opt.zero_grad()
        loss = wl.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        xm.mark_step()
        return loss

    warmup, rounds, steps = (2, 3, 2) if quick else (3, 5, 2)
    losses = [float(step().detach()) for _ in range(warmup)]
    compiles = met.counter_value("UncachedCompile") or 0
    times = []
    for _ in range(rounds):
        t0 = common.now()
        for _ in range(steps):
            loss = step()
        losses.append(float(loss.detach()))
        times.append((common.now() - t0) / steps)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    params = list(model.parameters())
    common.emit({
        "devices": n, "step_ms": common.median(times) * 1e3,
        "param_state_mb": _per_device_bytes(params + state) / 2**20,
        "param_mb": _per_device_bytes(params) / 2**20,
        "first_loss": losses[0], "last_loss": losses[-1],
        "recompiles_after_warmup": (met.counter_value("UncachedCompile") or 0) - compiles,
    })
    del torch_xla


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--devices", type=int, default=4)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.quick)
    results = {}
    for c in ("fsdp", "data", "single"):
        env = {"CPU_NUM_DEVICES": str(args.devices)}
        results[c] = common.run_worker(__file__, c, args, extra_env=env)
        print(c, {k: v for k, v in results[c].items() if k not in ("t_launch",)}, flush=True)
    base = results["single"].get("param_state_mb")
    print(f"\n{common.command_line()}\n")
    print("| contender | devices | params + optimizer state per device (MB) | vs one device | step (ms) "
          "| first loss | last loss | recompiles after warm-up | peak RSS (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c, r in results.items():
        if "error" in r:
            print(f"| {c} | error: {r['error'][:120]} |")
            continue
        print(f"| {c} | {r['devices'] if c != 'single' else 1} | {r['param_state_mb']:.2f} | "
              f"{r['param_state_mb'] / base:.2f} | {r['step_ms']:.1f} | {r['first_loss']:.4f} | "
              f"{r['last_loss']:.4f} | {r['recompiles_after_warmup']} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
