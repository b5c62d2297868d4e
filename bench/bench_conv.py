"""Convolution formulations on XLA:CPU: XLA's convolution vs patches times weights.

    PJRT_DEVICE=CPU python bench/bench_conv.py [--quick] [--rounds N]

For the convolutions of the MNIST CNN and of the ResNet-18-shaped benchmark model,
milliseconds of the forward, the input gradient and the weight gradient, each jitted
alone, for `lax.conv_general_dilated` and for `conv_cpu.conv_im2col` (what
torch_xla/_engine/lowering/conv_cpu.py picks on CPU). The two are timed in alternation
(A, B, A, B, ...) and the median over rounds is reported, so drift of a shared machine
hits both alike. One process, pure jax: no torch involved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, x shape, w shape, stride, padding)
SHAPES = [
    ("mnist conv1", (128, 1, 28, 28), (10, 1, 5, 5), 1, 0),
    ("mnist conv2", (128, 10, 12, 12), (20, 10, 5, 5), 1, 0),
    ("resnet stem 7x7/2", (32, 3, 64, 64), (64, 3, 7, 7), 2, 3),
    ("resnet 64 3x3", (32, 64, 16, 16), (64, 64, 3, 3), 1, 1),
    ("resnet 64->128 3x3/2", (32, 64, 16, 16), (128, 64, 3, 3), 2, 1),
    ("resnet 128 3x3", (32, 128, 8, 8), (128, 128, 3, 3), 1, 1),
    ("resnet 256 3x3", (32, 256, 4, 4), (256, 256, 3, 3), 1, 1),
    ("resnet 256->512 3x3/2", (32, 256, 4, 4), (512, 256, 3, 3), 2, 1),
    ("resnet 512 3x3 (2x2 maps)", (32, 512, 2, 2), (512, 512, 3, 3), 1, 1),
    ("resnet 64->128 1x1/2", (32, 64, 16, 16), (128, 64, 1, 1), 2, 0),
]


def _time(f, args, n):
    import jax
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="first three shapes, fewer repetitions")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import jax
    import numpy as np
    from torch_xla._engine.lowering import conv_cpu

    shapes = SHAPES[:3] if args.quick else SHAPES
    reps = 3 if args.quick else 7
    print(f"`PJRT_DEVICE=CPU python bench/bench_conv.py{' --quick' if args.quick else ''}`\n")
    print("| convolution | XLA fwd ms | im2col fwd ms | XLA grad-input ms | im2col grad-input ms "
          "| XLA grad-weight ms | im2col grad-weight ms |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, xs, ws, s, pd in shapes:
        nsp = len(xs) - 2
        st, pa, di = (s,) * nsp, (pd,) * nsp, (1,) * nsp
        x = jax.numpy.asarray(rng.standard_normal(xs, dtype=np.float32))
        w = jax.numpy.asarray(rng.standard_normal(ws, dtype=np.float32))
        fns = {}
        for label, conv in (("lax", conv_cpu.conv_lax), ("im2col", conv_cpu.conv_im2col)):
            f = lambda a, b, conv=conv: conv(a, b, st, pa, di)
            g = jax.numpy.ones(jax.eval_shape(f, x, w).shape, np.float32)
            fns[label] = (
                (jax.jit(f), (x, w)),
                (jax.jit(lambda a, b, g, f=f: jax.vjp(lambda a: f(a, b), a)[1](g)[0]), (x, w, g)),
                (jax.jit(lambda a, b, g, f=f: jax.vjp(lambda b: f(a, b), b)[1](g)[0]), (x, w, g)),
            )
        times = {k: [[], [], []] for k in fns}
        for _ in range(args.rounds):
            for label, parts in fns.items():
                for i, (f, a) in enumerate(parts):
                    times[label][i].append(_time(f, a, reps))
        med = {k: [statistics.median(v) for v in t] for k, t in times.items()}
        cells = []
        for i in range(3):
            cells += [f"{med['lax'][i]:.1f}", f"{med['im2col'][i]:.1f}"]
        print(f"| {name} {xs}x{ws} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
