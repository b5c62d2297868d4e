"""Compile time against depth: the decoder's layers unrolled vs run by `scan_layers`, and
`assume_pure`'s tracing time (first call vs later calls).

Per depth and mode, one fresh process trains the decoder of `models_torch.py` (hidden 256,
batch 4 x 128 tokens, SGD) and reports the first step's compile time (the `CompileTime`
metric), the first step's wall time and the median of the following steps.

  PJRT_DEVICE=CPU python bench/bench_scan_layers.py [--depths 4,8,16,32] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TAG = "BENCH_RESULT "


def worker(mode: str, depth: int, steps: int) -> dict:
    sys.path.insert(0, HERE)
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.debug.metrics as met
    from models_torch import DecoderConfig, DecoderOnly
    from torch_xla.experimental.scan import scan

    torch.manual_seed(0)
    cfg = DecoderConfig(num_hidden_layers=depth, max_seq=128)
    model = DecoderOnly(cfg).to("xla")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 128)).to("xla")
    labels = torch.randint(0, cfg.vocab_size, (4, 128)).to("xla")
    layer0 = model.layers[0]

    def step(carry, params):   # reads tensors only through its arguments; one function: scan's cache serves it
        h, c, s_, m = carry
        return (torch.func.functional_call(layer0, params, (h, c, s_, m)), c, s_, m), None

    def forward(ids):
        s = ids.shape[1]
        cos, sin, mask = model.rope_cos[:s], model.rope_sin[:s], model.causal_mask[:s, :s]
        x = model.embed_tokens(ids)
        if mode == "unrolled":
            for layer in model.layers:
                x = layer(x, cos, sin, mask)
        else:
            names = [n for n, _ in layer0.named_parameters()]
            stacked = {n: torch.stack([dict(l.named_parameters())[n] for l in model.layers]) for n in names}

            (x, _, _, _), _ = scan(step, (x, cos, sin, mask), stacked, is_fn_pure=True)
        return model.output(model.norm(x))

    torch_xla.sync(wait=True)
    times = []
    for k in range(steps + 1):
        t0 = time.perf_counter()
        logits = forward(ids)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync(wait=True)
        times.append(time.perf_counter() - t0)
        if os.environ.get("BENCH_VERBOSE"):
            print(k, times[-1], met.counter_value("UncachedCompile"), file=sys.stderr)
        if k == 0:
            compile_s = (met.metric_data("CompileTime") or (0, 0.0))[1] / 1e9
    return {"mode": mode, "depth": depth, "compile_s": compile_s, "first_step_s": times[0],
            "step_ms": statistics.median(times[1:]) * 1e3, "loss": float(loss.cpu())}


def pure_worker(layers: int, calls: int) -> dict:
    sys.path.insert(0, HERE)
    import torch
    import torch_xla
    from models_torch import DecoderConfig, DecoderOnly
    from torch_xla.experimental.assume_pure import assume_pure

    torch.manual_seed(0)
    cfg = DecoderConfig(num_hidden_layers=layers, max_seq=128)
    model = DecoderOnly(cfg).to("xla")
    ids = torch.randint(0, cfg.vocab_size, (2, 8)).to("xla")
    params = dict(model.named_parameters())
    torch_xla.sync(wait=True)

    def trace_plain():
        t0 = time.perf_counter()
        model(ids)
        return time.perf_counter() - t0

    pure = assume_pure(lambda p, x: torch.func.functional_call(model, p, (x,)))

    def trace_pure():
        t0 = time.perf_counter()
        pure(params, ids)
        return time.perf_counter() - t0

    first = trace_pure()
    later = statistics.median(trace_pure() for _ in range(calls))
    plain = statistics.median(trace_plain() for _ in range(calls))
    return {"layers": layers, "pure_first_ms": first * 1e3, "pure_later_ms": later * 1e3,
            "plain_ms": plain * 1e3}


def run(args: list) -> dict:
    out = subprocess.run([sys.executable, __file__] + args, capture_output=True, text=True,
                         env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="4,8,16,32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--pure-layers", default="4,16,64")
    a = ap.parse_args()
    if a.worker == "pure":
        print(TAG + json.dumps(pure_worker(a.depth, a.steps)), flush=True)
        return
    if a.worker:
        print(TAG + json.dumps(worker(a.worker, a.depth, a.steps)), flush=True)
        return
    depths = [int(d) for d in a.depths.split(",")]
    rows = {}
    for d in depths:
        for mode in ("unrolled", "scan"):
            rows[(mode, d)] = run(["--worker", mode, "--depth", str(d), "--steps", str(a.steps)])
    print("| layers | compile unrolled (s) | compile scan (s) | first step unrolled / scan (s) | "
          "step unrolled (ms) | step scan (ms) | scan / unrolled step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for d in depths:
        u, s = rows[("unrolled", d)], rows[("scan", d)]
        print(f"| {d} | {u['compile_s']:.2f} | {s['compile_s']:.2f} | {u['first_step_s']:.2f} / "
              f"{s['first_step_s']:.2f} | {u['step_ms']:.1f} | {s['step_ms']:.1f} | "
              f"{s['step_ms'] / u['step_ms']:.2f} |")
    base = rows[("scan", depths[0])]["compile_s"]
    print(f"\nscan compile time at {depths[-1]} layers / at {depths[0]}: "
          f"{rows[('scan', depths[-1])]['compile_s'] / base:.2f}x")
    print("\n| layers | plain forward trace (ms) | assume_pure first call (ms) | assume_pure later calls (ms) |")
    print("| --- | --- | --- | --- |")
    for n in [int(x) for x in a.pure_layers.split(",")]:
        r = run(["--worker", "pure", "--depth", str(n), "--steps", "5"])
        print(f"| {n} | {r['plain_ms']:.1f} | {r['pure_first_ms']:.1f} | {r['pure_later_ms']:.2f} |")


if __name__ == "__main__":
    main()
