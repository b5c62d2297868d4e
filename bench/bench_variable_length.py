"""Training on variable-length batches: padding to buckets (done by the user) vs bounded
dynamic shapes (`XLA_EXPERIMENTAL=masked_select`, docs/dynamic_shapes.md) vs padding to the
longest length, here and with the original.

    PJRT_DEVICE=CPU python bench/bench_variable_length.py [--steps 40] [--original-venv PATH]

The model: an embedding (vocabulary 512, width 128), two linear layers and a projection
to the vocabulary; a batch is 8 sequences of one length drawn from 64..512 (the same draw
for every mode, seed 0); SGD. Modes:
- `buckets`: each batch padded to the next multiple of 64, loss `cross_entropy` with
  `ignore_index` on the padding: a program per bucket seen (up to 8);
- `bounded`: every batch padded to 512, the per-token losses of the real tokens taken with
  `masked_select` and averaged: under the switch one program for every length;
- `pad_max`: every batch padded to 512, `ignore_index` on the padding: one program, no switch.
Each mode runs in a fresh process; `original_*` run the same worker under torch_xla 2.9.
Reported: programs compiled, wall time of all steps (compiles included), median step time
after each program was compiled once, and the last loss (equal across modes: the same
tokens count).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VOCAB, WIDTH, BATCH, LMIN, LMAX, BUCKET = 512, 128, 8, 64, 512, 64
MODES = ("buckets", "bounded", "pad_max")
SWITCH = {"bounded": "nonzero:masked_select:masked_scatter"}
LABELS = {"buckets": "pad to buckets of 64 (user)", "bounded": "bounded dynamic shapes (XLA_EXPERIMENTAL)",
          "pad_max": "pad to 512", "original_buckets": "original 2.9: pad to buckets",
          "original_bounded": "original 2.9: bounded dynamic shapes", "original_pad_max": "original 2.9: pad to 512"}
COLUMNS = [("compiles", "programs compiled"), ("total_s", "all steps s"), ("step_ms", "step ms (warm)"),
           ("last_loss", "loss last")]


def worker(mode: str, steps: int) -> dict:
    common.set_threads()
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(LMIN, LMAX + 1, (steps,), generator=g).tolist()
    batches = [(torch.randint(0, VOCAB, (BATCH, n), generator=g), torch.randint(0, VOCAB, (BATCH, n), generator=g))
               for n in lengths]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, VOCAB)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def padded(x, y, to):
        xp = torch.zeros(BATCH, to, dtype=x.dtype)
        yp = torch.full((BATCH, to), -100, dtype=y.dtype)
        xp[:, :x.shape[1]], yp[:, :y.shape[1]] = x, y
        return xp.to(dev), yp.to(dev)

    def step(x, y):
        n = x.shape[1]
        to = LMAX if mode != "buckets" else -(-n // BUCKET) * BUCKET
        xd, yd = padded(x, y, to)
        opt.zero_grad()
        logits = model(xd).view(-1, VOCAB)
        if mode == "bounded":
            per_token = F.cross_entropy(logits, yd.view(-1).clamp(min=0), reduction="none")
            loss = torch.masked_select(per_token, yd.view(-1) >= 0).mean()
        else:
            loss = F.cross_entropy(logits, yd.view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        xm.mark_step()
        return loss

    met.clear_all()
    seen, warm = set(), []
    t0 = common.now()
    for x, y in batches:
        key = -(-x.shape[1] // BUCKET) if mode == "buckets" else 0
        s0 = common.now()
        loss = step(x, y)
        xm.wait_device_ops()
        if key in seen:
            warm.append(common.now() - s0)
        seen.add(key)
    total = common.now() - t0
    ct = met.metric_data("CompileTime")
    return {"compiles": int(ct[0]) if ct else 0, "total_s": total,
            "step_ms": common.median(warm) * 1e3 if warm else None, "last_loss": float(loss.item())}


def main(argv=None):
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    if args.worker:
        return common.emit(worker(args.worker, common.parse_worker_args(args)["steps"]))
    results = {}
    names = list(MODES) + ([f"original_{m}" for m in MODES] if args.original_venv else [])
    for name in names:
        mode = name[len("original_"):] if name.startswith("original_") else name
        print(f"[variable length] {name} ...", file=sys.stderr, flush=True)
        results[name] = common.run_worker(__file__, name if name.startswith("original_") else mode, args,
                                          {"steps": args.steps},
                                          extra_env={"XLA_EXPERIMENTAL": SWITCH.get(mode, "")})
    table = common.markdown_table(f"Variable-length batches ({args.steps} steps, lengths {LMIN}..{LMAX})",
                                  results, COLUMNS, ratio_key="total_s", higher_is_better=False,
                                  command=common.command_line(), labels=LABELS)
    print(table, flush=True)
    return [table]


if __name__ == "__main__":
    main()
