"""Lowerings of the ops whose result has a data-dependent size, kept on the device with a
bounded shape (`XLA_EXPERIMENTAL`, docs/dynamic_shapes.md): each returns its data padded
to the upper bound, then the real size as a 0-d int64 value."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .table import lowering


@lowering("xla::bounded_nonzero")
def bounded_nonzero(x):
    """`nonzero` padded to numel rows (zeros past the real count), and the count."""
    flat = jnp.reshape(x, (-1,))
    hit = flat if flat.dtype == jnp.bool_ else flat != 0
    count = jnp.sum(hit, dtype=jnp.int64)
    if x.ndim == 0:
        return jnp.zeros((1, 0), jnp.int64), count
    n = flat.shape[0]
    (pos,) = jnp.nonzero(hit, size=n, fill_value=0)
    idx = jnp.unravel_index(pos, x.shape)
    rows = jnp.stack([a.astype(jnp.int64) for a in idx], axis=1)
    keep = jnp.arange(n) < count
    return jnp.where(keep[:, None], rows, 0), count


@lowering("xla::bounded_masked_select")
def bounded_masked_select(x, mask):
    """`masked_select` padded to the broadcast numel (zeros past the real count), and the count."""
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    flat = jnp.reshape(jnp.broadcast_to(x, shape), (-1,))
    hit = jnp.reshape(jnp.broadcast_to(mask, shape), (-1,))
    count = jnp.sum(hit, dtype=jnp.int64)
    n = flat.shape[0]
    (pos,) = jnp.nonzero(hit, size=n, fill_value=0)
    keep = jnp.arange(n) < count
    return jnp.where(keep, flat[pos], jnp.zeros((), flat.dtype)), count


@lowering("xla::bounded_nms")
def bounded_nms(boxes, scores, iou_threshold):
    """torchvision's `nms`: the kept boxes' indices by decreasing score, padded to the box
    count (zeros past the real count), and the count."""
    n = boxes.shape[0]
    order = jnp.argsort(-scores, stable=True)
    b = boxes[order].astype(jnp.promote_types(boxes.dtype, jnp.float32))
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = jnp.maximum(b[:, None, :2], b[None, :, :2])
    rb = jnp.minimum(b[:, None, 2:], b[None, :, 2:])
    wh = jnp.clip(rb - lt, 0)
    inter = wh[..., 0] * wh[..., 1]
    iou = inter / (area[:, None] + area[None, :] - inter)
    over = iou > iou_threshold

    def step(i, keep):
        # box i survives unless a kept box before it overlaps it
        hit = jnp.any(keep & over[:, i] & (jnp.arange(n) < i))
        return keep.at[i].set(~hit)

    keep = jax.lax.fori_loop(0, n, step, jnp.zeros((n,), jnp.bool_))
    count = jnp.sum(keep, dtype=jnp.int64)
    (pos,) = jnp.nonzero(keep, size=n, fill_value=0)
    out = jnp.where(jnp.arange(n) < count, order[pos].astype(jnp.int64), 0)
    return out, count


@lowering("xla::bounded_mask")
def bounded_mask(x, *sizes_and_dims):
    """`x` with the entries past the real size of each listed dimension set to `fill`:
    arguments are the sizes (0-d values), then the dimensions, then the fill value."""
    k = (len(sizes_and_dims) - 1) // 2
    sizes, dims, fill = sizes_and_dims[:k], sizes_and_dims[k:2 * k], sizes_and_dims[-1]
    keep = jnp.ones(x.shape, jnp.bool_)
    for s, d in zip(sizes, dims):
        shape = [1] * x.ndim
        shape[d] = x.shape[d]
        keep = keep & (jnp.reshape(jnp.arange(x.shape[d]), shape) < s)
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))
