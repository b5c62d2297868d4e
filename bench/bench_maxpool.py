"""Max pooling lowerings on the device: gather windows / scatter gradient (the general
path) versus reshape windows / elementwise gradient (the path for windows that tile the
input), at the MNIST CNN's two pooling shapes, k=2.

    PJRT_DEVICE=CPU python bench/bench_maxpool.py

Prints the median of 30 runs of each jitted function, in ms.
"""
from __future__ import annotations

import time
from unittest import mock

import numpy as np


def main() -> None:
    import torch_xla  # noqa: F401  (configures jax)
    from torch_xla._engine import pjrt
    from torch_xla._engine.lowering import pooling
    jax = pjrt.jax_module()
    jnp = jax.numpy

    def median_ms(f, *a):
        jf = jax.jit(f)
        jax.block_until_ready(jf(*a))
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            jax.block_until_ready(jf(*a))
            ts.append(time.perf_counter() - t)
        return sorted(ts)[15] * 1e3

    for shape in [(128, 10, 24, 24), (128, 20, 8, 8)]:
        k, osz = (2, 2), (shape[2] // 2, shape[3] // 2)
        idxs, valids = zip(*[pooling._window_index(shape[2 + i], osz[i], 2, 2, 0, 1) for i in range(2)])
        x = jnp.asarray(np.random.default_rng(0).random(shape, dtype=np.float32))
        with mock.patch.object(pooling, "out_shape", lambda i=0: shape[:2] + osz):
            gather = lambda a: pooling._max_windows(a, list(idxs), list(valids))
            tiled = lambda a: pooling._max_windows(a, list(idxs), list(valids), (k, osz))
            v, ind = jax.jit(gather)(x)
            v2, ind2 = jax.jit(tiled)(x)
            assert bool(jnp.all(v == v2)) and bool(jnp.all(ind == ind2))
            fg, ft = median_ms(gather, x), median_ms(tiled, x)
        g = jnp.ones_like(v)
        bs = median_ms(lambda g, a, i: pooling._index_backward(g, a, i, 2), g, x, ind)
        bt = median_ms(lambda g, a, i: pooling._tiled_backward(g, a, i, k), g, x, ind)
        print(f"{shape}: forward gather {fg:.2f} ms, reshape {ft:.2f} ms; "
              f"backward scatter {bs:.2f} ms, elementwise {bt:.2f} ms")


if __name__ == "__main__":
    main()
