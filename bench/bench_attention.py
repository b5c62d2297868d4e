"""Attention forward + backward on the xla device: `custom_kernel.flash_attention` (blockwise)
vs `torch.nn.functional.scaled_dot_product_attention` (PyTorch's math path, which holds the
sequence x sequence matrices), batch 1, 8 heads, head dim 64, at several sequence lengths.

    PJRT_DEVICE=CPU python bench/bench_attention.py [--quick] [--seqs 1024,4096,8192] [--flash-only 32768]
        [--flash-only-steps 0]

One fresh subprocess per (kernel, length). Peak memory is the compiled step program's
memory analysis (`executable.memory_analysis()`: argument + output + temp bytes; the
temp bytes are XLA's buffer assignment for intermediates, what the sequence x sequence
matrices would occupy); it is read from the engine's compile cache after the first step,
the program that computes the loss and the three gradients. Time is the median wall time
of a step after the first (sync + wait). For lengths given with --flash-only, one step
runs and its time is the step's wall time minus its compile time (it still includes the
one-time tracing of the jax functions, a few seconds); `--flash-only-steps 0` only compiles
the step's program (memory analysis, no time).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HEADS, HEAD_DIM = 8, 64


def worker_xla(kernel: str, seq: int, steps: int) -> dict:
    import math
    import time

    import torch
    import torch.nn.functional as F

    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla._engine.executor import compile as xcompile
    from torch_xla.experimental.custom_kernel import flash_attention
    common.set_threads()
    stats = common.XlaCompileStats()
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=g).to(dev).requires_grad_() for _ in range(3))
    xm.wait_device_ops()
    scale = 1 / math.sqrt(HEAD_DIM)

    def step():
        for t in (q, k, v):
            t.grad = None
        if kernel == "flash":
            out = flash_attention(q, k, v, sm_scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        out.sum().backward()
        torch_xla.sync()
        xm.wait_device_ops()

    if steps == 0:
        # compile only: the step's program (same graph as a sync would run), not executed
        for t in (q, k, v):
            t.grad = None
        out = flash_attention(q, k, v, sm_scale=scale) if kernel == "flash" else \
            F.scaled_dot_product_attention(q, k, v, scale=scale)
        loss = out.sum()
        loss.backward()
        from torch_xla import _XLAC
        from torch_xla._engine import executor
        t0 = time.perf_counter()
        exe = executor.lowered(_XLAC._roots([loss, q.grad, k.grad, v.grad])).compile()
        m = exe.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return {"peak_mb": total / 2 ** 20, "temp_mb": m.temp_size_in_bytes / 2 ** 20, "step_s": None,
                "compile_s": time.perf_counter() - t0}
    xcompile.clear_cache()
    times = []
    for _ in range(steps):
        c0, s0 = stats.snapshot()
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        c1, s1 = stats.snapshot()
        times.append((dt, s1 - s0, c1 - c0))
    best = None
    for exes in xcompile._cache.values():
        for exe in exes:
            m = exe.compiled.memory_analysis()
            total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            if best is None or total > best[0]:
                best = (total, m.temp_size_in_bytes)
    if steps > 1:
        step_s = common.median([t for t, _, _ in times[1:]])
    else:
        step_s = times[0][0] - times[0][1]
    return {"peak_mb": best[0] / 2 ** 20, "temp_mb": best[1] / 2 ** 20, "step_s": step_s,
            "compile_s": times[0][1], "compiles_after_warmup": sum(c for _, _, c in times[1:])}


def main() -> None:
    p = common.base_parser(__doc__)
    p.add_argument("--seqs", default="1024,4096,8192", help="lengths for both kernels")
    p.add_argument("--flash-only", default="32768", help="lengths for the flash kernel alone ('' for none)")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first compiles)")
    p.add_argument("--flash-only-steps", type=int, default=1,
                   help="steps of the --flash-only runs (0: compile only, memory without a time)")
    args = p.parse_args()
    if args.worker:
        wa = common.parse_worker_args(args)
        common.emit(worker_xla(wa["kernel"], wa["seq"], wa["steps"]))
        return
    seqs = [int(s) for s in args.seqs.split(",") if s]
    long = [int(s) for s in args.flash_only.split(",") if s]
    if args.quick:
        seqs, long = [256, 512], [1024]
    runs = [(kern, s, args.steps) for s in seqs for kern in ("flash", "sdpa")] + [("flash", s, args.flash_only_steps) for s in long]
    rows = {}
    for kern, seq, steps in runs:
        r = common.run_worker(__file__, "xla", args, {"kernel": kern, "seq": seq, "steps": steps})
        rows[f"{kern} L={seq}"] = r
        print(f"{kern} L={seq}: " + (r.get("error") or
              f"peak {r['peak_mb']:.1f} MB, temp {r['temp_mb']:.1f} MB, step {r['step_s']} s"),
              file=sys.stderr, flush=True)
    notes = []
    for s in seqs:
        f, n = rows.get(f"flash L={s}", {}), rows.get(f"sdpa L={s}", {})
        if f.get("peak_mb") and n.get("peak_mb"):
            notes.append(f"L={s}: flash peak / sdpa peak = {f['peak_mb'] / n['peak_mb']:.3f}")
    flash = sorted((int(k.split("=")[1]), r["peak_mb"]) for k, r in rows.items()
                   if k.startswith("flash") and r.get("peak_mb"))
    for (s0, p0), (s1, p1) in zip(flash, flash[1:]):
        notes.append(f"flash peak L={s0} -> L={s1} (x{s1 / s0:g} length): x{p1 / p0:.2f} memory")
    print(common.markdown_table(
        f"Attention forward + backward, batch 1, {HEADS} heads, head dim {HEAD_DIM}", rows,
        [("peak_mb", "peak MB (arg + out + temp)"), ("temp_mb", "temp MB"), ("step_s", "step s (median)"),
         ("compile_s", "compile s")],
        command=common.command_line(), notes=notes, labels={k: k for k in rows}))


if __name__ == "__main__":
    main()
