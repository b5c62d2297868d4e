"""Formulations of lowerings inside a whole training step, in one process: the engine's
against alternatives kept here.

--compare patch-layout: the convolution patch matrix on CPU channels-last (rows (n,
  out...), columns (k..., c): the engine's earlier layout) vs transposed (rows (c, k...),
  columns (n, out...): `lowering/conv_cpu.conv_im2col`).
--compare patches (default): convolution patch matrices on CPU as one slice per kernel
  offset (k1 * k2 slices) vs one spatial dimension at a time (k1 + k2 slices,
  `lowering/conv_cpu._stacked_slices`).
--compare chunks [--chunk N]: one patch product per slice of N images of the batch
  (patch matrices small enough to stay in cache), concatenated, vs one per convolution.
--compare patch-grad: the patches' gradient (the input gradient before the padding is
  cut off) as `jax.vjp` of the stacked slices (one stage of pads and adds per spatial
  dimension) vs one sum, over every kernel offset, of that offset's slice of the patch
  gradient padded back into place (`conv_cpu._patches_bwd`).
--compare input-grad: a convolution's input gradient as patches of the (dilated,
  padded) output gradient times the flipped kernel (a gather and one product), or (stride
  1) as XLA's own convolution, vs the engine's `jax.vjp` of the patch product (the patch
  gradient scattered back by pads and adds).
--compare maxpool: max pooling over tiling windows as a running max over the window
  offsets' strided slices, gradient compared per offset at the windows' resolution vs
  the engine's windows cut by reshape + transpose with an argmax, gradient by repeated
  flat indices (`pooling._max_windows`, `pooling._tiled_backward`).
--compare softmax (use --model decoder or decoder8): softmax as exp(z) * (1 / sum(exp(z)))
  vs exp(z - log(sum(exp(z)))), z = x - max(x), both patched in (`reductions.softmax`
  picks the first where the products are the BLAS handler's, the second elsewhere). XLA
  fuses the cheap scaling of exp(z) into every consumer of the probabilities, including
  the backward, so exp(z) stays alive next to them from the forward to the backward
  unless a library call reads them materialized; an exp as the last op is not
  duplicated, so only the probabilities are kept.

    PJRT_DEVICE=CPU python bench/bench_patches.py [--compare patches] [--model mnist] [--rounds 15]

Traces one training step of a benchmark model (bench/models_torch.py) on the xla device,
lowers the same graph once per formulation, compiles both (compile time) and runs them in
alternation on the same buffers (A, B, A, B, ...), so the drift of a shared machine hits
both alike. Prints StableHLO op counts, compile times, median and minimum step times
, XLA's temporary buffer per step and the largest relative difference between the
programs' outputs. Programs are compiled with the engine's compiler options for the graph
(as the executor compiles them) but without donation.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def per_offset_patches(xp, k, out, stride, dilation):
    """`conv_cpu._stacked_slices` as one strided slice of the padded (C, N, spatial...)
    input per kernel offset (k1 * k2 slices), stacked into the same (c, k..., n, out...)
    layout."""
    import jax.numpy as jnp
    from jax import lax
    c, n = xp.shape[:2]
    slices = []
    for off in itertools.product(*(range(kk) for kk in k)):
        start = (0, 0) + tuple(a * d for a, d in zip(off, dilation))
        limit = (c, n) + tuple(st + (m - 1) * s + 1 for st, m, s in zip(start[2:], out, stride))
        slices.append(lax.slice(xp, start, limit, (1, 1) + tuple(stride)))
    return jnp.stack(slices, axis=1).reshape((c,) + tuple(k) + (n,) + tuple(out))


def gather_input_grad(g, x_shape, w, stride, padding, dilation):
    """The input gradient of a patch-product convolution as a stride-1 convolution of the
    output gradient (interior-padded by stride - 1, edge-padded to the input's extent)
    with the spatially flipped, transposed kernel, through its own patch matrix."""
    import jax.numpy as jnp
    from jax import lax
    from torch_xla._engine.lowering import conv_cpu
    nsp = g.ndim - 2
    k = w.shape[2:]
    pads = [(0, 0, 0), (0, 0, 0)]
    for i in range(nsp):
        lo = dilation[i] * (k[i] - 1) - padding[i]
        span = (g.shape[2 + i] - 1) * stride[i] + 1
        pads.append((lo, x_shape[2 + i] + dilation[i] * (k[i] - 1) - lo - span, stride[i] - 1))
    gp = lax.pad(g, jnp.zeros((), g.dtype), pads)
    wt = jnp.flip(jnp.swapaxes(w, 0, 1), axis=tuple(range(2, 2 + nsp)))
    return conv_cpu.conv_im2col(gp, wt, (1,) * nsp, (0,) * nsp, dilation)


def convolution_backward_gather(g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                                groups, output_mask=(True, True, True)):
    """`aten::convolution_backward` with the input gradient from `gather_input_grad`
    (CPU patch formulation) and the weight gradient from `jax.vjp` as in the engine."""
    import jax
    import jax.numpy as jnp
    from torch_xla._engine.lowering import conv_cpu, conv, nn_common
    w, g = w.astype(x.dtype), g.astype(x.dtype)
    nsp = x.ndim - 2
    st, pd, dl = nn_common._tup(stride, nsp), nn_common._tup(padding, nsp), nn_common._tup(dilation, nsp)
    f = lambda xx, ww: conv._conv(xx, ww, stride, padding, dilation, transposed, output_padding, groups)
    gx = gw = None
    if (nn_common._has_out(0) and conv._cpu_formulation(x, transposed, groups)
            and conv_cpu.use_im2col(x.shape, w.shape, st, pd, dl)):
        gx = gather_input_grad(g, x.shape, w, st, pd, dl)
        if nn_common._has_out(1):
            gw, = jax.vjp(lambda ww: f(x, ww), w)[1](g)
    else:
        gx, gw = jax.vjp(f, x, w)[1](g)
    gb = jnp.sum(g, axis=(0,) + tuple(range(2, g.ndim))) if nn_common._has_out(2) else None
    return nn_common._fill((gx if nn_common._has_out(0) else None, gw if nn_common._has_out(1) else None, gb))


def sliced_max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nsp):
    """`pooling._max_pool` with tiling windows taken as a running max over the window
    offsets' strided slices (elementwise; the CPU kernel's rule: greater, or NaN)."""
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from torch_xla._engine.lowering import nn_common, nn_ops, pooling
    k = nn_common._tup(kernel_size, nsp)
    s = nn_common._tup(stride, nsp, k)
    p, d = nn_common._tup(padding, nsp), nn_common._tup(dilation, nsp)
    osz, isz = nn_ops.out_shape(0)[-nsp:], x.shape[-nsp:]
    if not pooling._tiled(k, s, p, d, osz, isz):
        return ENGINE_MAX_POOL(x, kernel_size, stride, padding, dilation, ceil_mode, nsp)
    lead = x.ndim - nsp
    m = j = None
    for off_i, off in enumerate(itertools.product(*(range(kk) for kk in k))):
        limit = x.shape[:lead] + tuple(o + (n - 1) * kk + 1 for o, n, kk in zip(off, osz, k))
        v = lax.slice(x, (0,) * lead + off, limit, (1,) * lead + tuple(k))
        if m is None:
            m, j = v, jnp.zeros(v.shape, jnp.int32)
            continue
        upd = (v > m) | jnp.isnan(v) if jnp.issubdtype(x.dtype, jnp.floating) else v > m
        m, j = jnp.where(upd, v, m), jnp.where(upd, jnp.int32(off_i), j)
    j = j.astype(jnp.int64)
    ind = jnp.zeros((), jnp.int64)
    for i in range(nsp):
        shape = [1] * nsp
        shape[i] = osz[i]
        pos = jnp.asarray(np.arange(osz[i]).reshape(shape) * k[i]) + (j // int(np.prod(k[i + 1:]))) % k[i]
        ind = ind + pos * int(np.prod(isz[i + 1:]))
    return m, ind


def offset_max_pool_backward(g, x, indices, k):
    """Tiling-window max-pool gradient comparing each element's window offset (small
    integers at the windows' resolution) instead of repeated flat indices."""
    import jax.numpy as jnp
    import numpy as np
    n = len(k)
    isz = x.shape[-n:]
    lead = g.ndim - n
    j = jnp.zeros((), jnp.int32)
    for i in range(n):
        coord = (indices // int(np.prod(isz[i + 1:]))) % isz[i]
        j = j * k[i] + (coord % k[i]).astype(jnp.int32)
    gu, ju = g, j
    for i in range(n):
        gu, ju = jnp.repeat(gu, k[i], lead + i), jnp.repeat(ju, k[i], lead + i)
    own = np.zeros((), np.int32)
    for i in range(n):
        shape = [1] * n
        shape[i] = gu.shape[lead + i]
        own = own * k[i] + (np.arange(gu.shape[lead + i]) % k[i]).reshape(shape).astype(np.int32)
    y = jnp.where(ju == jnp.asarray(own), gu, jnp.zeros((), g.dtype))
    return jnp.pad(y, [(0, 0)] * lead + [(0, isz[i] - y.shape[lead + i]) for i in range(n)])


# The engine's own functions, for alternatives that fall back to or wrap them (set in main).
ENGINE_MAX_POOL = None
ENGINE_IM2COL = None


CHUNK_ROWS = 8


def chunked_conv_im2col(x, w, stride, padding, dilation):
    """`conv_cpu.conv_im2col` over slices of the batch (CHUNK_ROWS images each), results
    concatenated: each slice's patch matrix is a fraction of the whole one, small enough
    to still be in cache when its product (and, backward, its gradient) reads it."""
    import jax.numpy as jnp
    n = x.shape[0]
    if n <= CHUNK_ROWS:
        return ENGINE_IM2COL(x, w, stride, padding, dilation)
    parts = [ENGINE_IM2COL(x[i:i + CHUNK_ROWS], w, stride, padding, dilation)
             for i in range(0, n, CHUNK_ROWS)]
    return jnp.concatenate(parts, axis=0)


def channels_last_im2col(x, w, stride, padding, dilation):
    """`conv_cpu.conv_im2col` with the patch matrix channels-last (the engine's earlier
    layout): rows (n, out...), columns (k..., c), cut from the input moved to
    (N, spatial..., C); the weights are reordered to (k..., C, O) to multiply it from the
    right, and the product (N, out..., O) is moved back to NC...."""
    import math
    import jax.numpy as jnp
    from jax import lax
    from torch_xla._engine.lowering import conv_cpu
    nsp = x.ndim - 2
    n, c = x.shape[:2]
    o = w.shape[0]
    k = w.shape[2:]
    out = conv_cpu._out_sizes(x.shape, k, stride, padding, dilation)
    cur = jnp.pad(jnp.moveaxis(x, 1, -1), ((0, 0),) + tuple((p, p) for p in padding) + ((0, 0),))
    for i in range(nsp):
        cur = jnp.stack([lax.slice_in_dim(cur, off * dilation[i], off * dilation[i] + (out[i] - 1) * stride[i] + 1,
                                          stride[i], axis=1 + i) for off in range(k[i])], axis=-2)
    patches = cur.reshape((n * math.prod(out), math.prod(k) * c))
    wm = jnp.moveaxis(w, (0, 1), (-1, -2)).reshape((math.prod(k) * c, o))
    y = jnp.matmul(patches, wm, precision=lax.Precision.HIGHEST).reshape((n,) + out + (o,))
    return jnp.moveaxis(y, -1, 1)


def per_image_im2col(x, w, stride, padding, dilation):
    """`conv_cpu.conv_im2col` with one patch matrix per image, (n, c k..., out...), cut
    from the input in its own NC... order: the forward is a batched product over the
    images with NC... output as it is, the weight gradient a batched product summed over
    the images, the input gradient a batched product and one sum of padded slices. No
    operand is transposed."""
    import math
    import jax
    import jax.numpy as jnp
    from jax import lax
    from torch_xla._engine.lowering import conv_cpu
    nsp = x.ndim - 2
    n, c = x.shape[:2]
    o = w.shape[0]
    k = tuple(w.shape[2:])
    out = conv_cpu._out_sizes(x.shape, k, stride, padding, dilation)
    ck, npos = c * math.prod(k), math.prod(out)
    hi = lax.Precision.HIGHEST
    bdims = (((2,), (1,)), ((0,), (0,)))

    def patches(xp):
        cur = xp
        for i in range(nsp):
            ax = 2 + 2 * i
            cur = jnp.stack([lax.slice_in_dim(cur, off * dilation[i], off * dilation[i] + (out[i] - 1) * stride[i] + 1,
                                              stride[i], axis=ax) for off in range(k[i])], axis=2 + i)
        return cur.reshape((n, ck, npos))

    @jax.custom_vjp
    def conv(xx, ww):
        return fwd(xx, ww)[0]

    def fwd(xx, ww):
        xp = jnp.pad(xx, ((0, 0), (0, 0)) + tuple((p, p) for p in padding))
        pt = patches(xp)
        wb = jnp.broadcast_to(ww.reshape((1, o, ck)), (n, o, ck))
        y = lax.dot_general(wb, pt, bdims, precision=hi)
        return y.reshape((n, o) + out), (pt, ww)

    def bwd(res, g):
        pt, ww = res
        xps = (n, c) + tuple(s + 2 * p for s, p in zip(x.shape[2:], padding))
        g = g.reshape((n, o, npos))
        gw = lax.dot_general(g, pt, (((2,), (2,)), ((0,), (0,))), precision=hi).sum(0).reshape(ww.shape)
        wt = jnp.broadcast_to(ww.reshape((1, o, ck)).swapaxes(1, 2), (n, ck, o))
        gp = lax.dot_general(wt, g, bdims, precision=hi).reshape((n, c) + k + out)
        zero = jnp.zeros((), g.dtype)
        total = None
        for off in itertools.product(*(range(kk) for kk in k)):
            cfg = [(0, 0, 0), (0, 0, 0)]
            for i, of in enumerate(off):
                lo = of * dilation[i]
                cfg.append((lo, xps[2 + i] - lo - (out[i] - 1) * stride[i] - 1, stride[i] - 1))
            term = lax.pad(gp[(slice(None), slice(None)) + off], zero, cfg)
            total = term if total is None else total + term
        gx = total[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in zip(padding, x.shape[2:]))]
        return gx, gw

    conv.defvjp(fwd, bwd)
    return conv(x, w)


def xla_input_grad_im2col(x, w, stride, padding, dilation):
    """The engine's `conv_cpu.conv_im2col` (forward, weight gradient) with the input
    gradient of a stride-1 convolution as XLA's own convolution of the padded output
    gradient with the flipped, transposed kernel (what `jax.vjp` of `conv_cpu.conv_lax`
    gives), instead of the patch gradient's sum of padded slices."""
    import jax
    from torch_xla._engine.lowering import conv_cpu
    if any(s != 1 for s in stride):
        return ENGINE_IM2COL(x, w, stride, padding, dilation)

    @jax.custom_vjp
    def conv(xx, ww):
        return ENGINE_IM2COL(xx, ww, stride, padding, dilation)

    def fwd(xx, ww):
        return conv(xx, ww), (xx, ww)

    def bwd(res, g):
        xx, ww = res
        gw = jax.vjp(lambda b: ENGINE_IM2COL(xx, b, stride, padding, dilation), ww)[1](g)[0]
        gx = jax.vjp(lambda a: conv_cpu.conv_lax(a, ww, stride, padding, dilation), xx)[1](g)[0]
        return gx, gw

    conv.defvjp(fwd, bwd)
    return conv(x, w)


def scaled_softmax(x, dim, half_to_float=False):
    """`aten::_softmax` as exp(z) * (1 / sum(exp(z)))."""
    from torch_xla._engine.lowering import reductions
    z, axis = reductions._softmax_parts(x, dim)
    return reductions._out(reductions.scaled_softmax_of(z, axis))


def logsumexp_softmax(x, dim, half_to_float=False):
    """`aten::_softmax` as exp(z - log(sum(exp(z))))."""
    import jax.numpy as jnp
    from torch_xla._engine.lowering import reductions
    z, axis = reductions._softmax_parts(x, dim)
    return reductions._out(jnp.exp(reductions.log_softmax_of(z, axis)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", default="patches", choices=("patches", "patch-grad", "input-grad", "maxpool", "softmax",
                                                    "chunks", "patch-layout"))
    p.add_argument("--chunk", type=int, default=16, help="--compare chunks: images per slice of the batch")
    p.add_argument("--model", default="mnist", help="mnist, resnet18, decoder, or decoder8 (batch 8 x 256)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    import torch
    import common
    import models_torch
    from torch_xla._engine import pjrt
    from torch_xla._engine.platform import policy
    from torch_xla._engine.lowering import conv_cpu
    jax = pjrt.jax_module()
    import jax.numpy as jnp

    torch.set_num_threads(2)
    graph, params = common.traced_step_graph(models_torch.decoder_workload(8, 256) if args.model == "decoder8"
                                             else models_torch.workload(args.model))
    from torch_xla._engine.executor.lower import build_fn
    pol = policy(pjrt.platform())
    blas = pol.library_products()
    opts = pol.compiler_options(graph.op_avals(), blas)
    global ENGINE_MAX_POOL, ENGINE_IM2COL, CHUNK_ROWS
    ENGINE_IM2COL = conv_cpu.conv_im2col
    CHUNK_ROWS = args.chunk
    from torch_xla._engine.lowering import LOWERINGS, pooling
    ENGINE_MAX_POOL = pooling._max_pool
    if args.compare == "patches":
        variants = {"one slice per offset": {(conv_cpu, "_stacked_slices"): per_offset_patches},
                    "one dimension at a time (engine)": {}}
    elif args.compare == "patch-grad":
        variants = {"vjp of the slices, one stage per dimension": {(conv_cpu, "_patches"): conv_cpu._stacked_slices},
                    "one sum over kernel offsets (engine)": {}}
    elif args.compare == "input-grad":
        variants = {"patches of the output gradient": {
                        (LOWERINGS["convolution_backward.default"], "fn"): convolution_backward_gather},
                    "XLA's convolution (stride 1)": {(conv_cpu, "conv_im2col"): xla_input_grad_im2col},
                    "vjp of the patch product (engine)": {}}
    elif args.compare == "softmax":
        variants = {"exp(z) * (1 / sum(exp(z)))": {(LOWERINGS["_softmax.default"], "fn"): scaled_softmax},
                    "exp(z - logsumexp(z))": {(LOWERINGS["_softmax.default"], "fn"): logsumexp_softmax}}
    elif args.compare == "chunks":
        variants = {f"patch products per {args.chunk} images": {(conv_cpu, "conv_im2col"): chunked_conv_im2col},
                    "one patch product per convolution (engine)": {}}
    elif args.compare == "patch-layout":
        variants = {"channels last: (n out...) x (k... c)": {(conv_cpu, "conv_im2col"): channels_last_im2col},
                    "per image: (n, c k..., out...)": {(conv_cpu, "conv_im2col"): per_image_im2col},
                    "transposed: (c k...) x (n out...) (engine)": {}}
    else:
        variants = {"strided slices, offsets": {(pooling, "_max_pool"): sliced_max_pool,
                                                (pooling, "_tiled_backward"): offset_max_pool_backward},
                    "reshape windows, repeated indices (engine)": {}}
    exes, info = {}, {}
    for name, patches in variants.items():
        saved = {key: getattr(*key) for key in patches}
        try:
            for (obj, attr), impl in patches.items():
                setattr(obj, attr, impl)
            fn = build_fn(graph, pol.patch_convolutions, checks=True, widen_int4_dots=pol.widen_int4_dots,
                          library_products=blas)
            lowered = jax.jit(fn, keep_unused=True).lower(*params)
            t0 = time.perf_counter()
            exes[name] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
            info[name] = (lowered.as_text().count("stablehlo."), time.perf_counter() - t0,
                          exes[name].memory_analysis().temp_size_in_bytes / 2 ** 20)
        finally:
            for (obj, attr), impl in saved.items():
                setattr(obj, attr, impl)
    outs = [e(*params) for e in exes.values()]
    diff = max(float(jnp.abs(a - b).max() / (jnp.abs(a).max() + 1e-30))
               for other in outs[1:] for a, b in zip(outs[0], other) if a.size)
    times = {k: [] for k in exes}
    for _ in range(args.rounds):
        for name, exe in exes.items():
            jax.block_until_ready(exe(*params))
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*params))
            times[name].append(time.perf_counter() - t0)
    print(f"`PJRT_DEVICE=CPU python bench/bench_patches.py --compare {args.compare} --model {args.model} "
          f"--rounds {args.rounds}`\n")
    print(f"| {args.compare} | StableHLO ops | compile s | temp buffer MiB | step ms (median) | step ms (min) |")
    print("|---|---|---|---|---|---|")
    for name in exes:
        ops, cs, temp = info[name]
        print(f"| {name} | {ops} | {cs:.2f} | {temp:,.0f} | {statistics.median(times[name]) * 1e3:.1f} | "
              f"{min(times[name]) * 1e3:.1f} |")
    print(f"\nlargest relative difference between the programs' outputs: {diff:.1e}")


if __name__ == "__main__":
    main()
