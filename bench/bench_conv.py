"""Convolution formulations on XLA:CPU: XLA's convolution vs patches times weights.

    PJRT_DEVICE=CPU python bench/bench_conv.py [--quick] [--rounds N]
        [--xla-variants '{"eigen": {"xla_cpu_experimental_ynn_fusion_type": "..."}}']

For the convolutions of the MNIST CNN and of the ResNet-18-shaped benchmark model,
milliseconds of the forward, the input gradient and the weight gradient, each jitted
alone, for `lax.conv_general_dilated` and for `conv_cpu.conv_im2col` (what
torch_xla/_engine/lowering/conv_cpu.py picks on CPU). The two are timed in alternation
(A, B, A, B, ...) and the median over rounds is reported, so drift of a shared machine
hits both alike. One process, pure jax, with the C heap configured as a training process
on CPU has it (`PT_XLA_RETAIN_HOST_MEMORY`). `--xla-variants` adds XLA's
convolution compiled with other XLA options (one column per variant and part); every
variant's outputs are checked against the default's (relative error below 1e-4).
"""
from __future__ import annotations

import argparse
import json
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
    ("cifar 16 3x3 (32x32 maps)", (64, 16, 32, 32), (16, 16, 3, 3), 1, 1),
    ("64 3x3 (32x32 maps)", (32, 64, 32, 32), (64, 64, 3, 3), 1, 1),
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
    p.add_argument("--xla-variants", default="{}",
                   help='JSON {"name": {XLA option: value}}: XLA\'s convolution compiled with these options too')
    args = p.parse_args(argv)
    from torch_xla._engine.platform import host_memory
    # The C heap as a training process has it (platform/host_memory.py), set before jax's
    # client starts: otherwise every patch matrix over glibc's mmap threshold is mapped and
    # page-faulted afresh at each call, which a training step does not pay.
    retained = host_memory.configure()
    import jax
    import numpy as np
    from torch_xla._engine.lowering import conv_cpu

    variants = json.loads(args.xla_variants)
    shapes = SHAPES[:3] if args.quick else SHAPES
    reps = 3 if args.quick else 7
    # column label -> (formulation, XLA options); the first is the variants' reference
    forms = {"XLA": (conv_cpu.conv_lax, {}), **{f"XLA {v}": (conv_cpu.conv_lax, o) for v, o in variants.items()},
             "im2col": (conv_cpu.conv_im2col, {})}
    labels = list(forms)
    cmd = ("PJRT_DEVICE=CPU python bench/bench_conv.py" + (" --quick" if args.quick else "")
           + (f" --rounds {args.rounds}" if args.rounds != 3 else ""))
    if variants:
        cmd += f" --xla-variants '{args.xla_variants}'"
    print(f"`{cmd}`{'' if retained else ' (C heap left as glibc has it: PT_XLA_RETAIN_HOST_MEMORY=0 or not glibc)'}\n")
    print("| convolution | " + " | ".join(f"{h} {part} ms" for part in ("fwd", "grad-input", "grad-weight")
                                          for h in labels) + " |")
    print("|---" * (1 + 3 * len(labels)) + "|")
    rng = np.random.default_rng(0)
    for name, xs, ws, s, pd in shapes:
        nsp = len(xs) - 2
        st, pa, di = (s,) * nsp, (pd,) * nsp, (1,) * nsp
        x = jax.numpy.asarray(rng.standard_normal(xs, dtype=np.float32))
        w = jax.numpy.asarray(rng.standard_normal(ws, dtype=np.float32))
        fns = {}
        for label, (conv, opts) in forms.items():
            f = lambda a, b, conv=conv: conv(a, b, st, pa, di)
            g = jax.numpy.ones(jax.eval_shape(f, x, w).shape, np.float32)
            parts = ((f, (x, w)),
                     (lambda a, b, g, f=f: jax.vjp(lambda a: f(a, b), a)[1](g)[0], (x, w, g)),
                     (lambda a, b, g, f=f: jax.vjp(lambda b: f(a, b), b)[1](g)[0], (x, w, g)))
            fns[label] = [(jax.jit(fn).lower(*a).compile(compiler_options=opts), a) for fn, a in parts]
        for label in labels[1:-1]:
            for (f, a), (f0, _) in zip(fns[label], fns["XLA"]):
                got, want = np.asarray(f(*a)), np.asarray(f0(*a))
                err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                if err > 1e-4:
                    raise SystemExit(f"{name}: variant {label} differs from XLA's default (relative error {err:.2g})")
        times = {k: [[], [], []] for k in fns}
        for _ in range(args.rounds):
            for label, parts in fns.items():
                for i, (f, a) in enumerate(parts):
                    times[label][i].append(_time(f, a, reps))
        med = {k: [statistics.median(v) for v in t] for k, t in times.items()}
        cells = [f"{med[k][i]:.1f}" for i in range(3) for k in labels]
        print(f"| {name} {xs}x{ws} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
