"""Seeing a layout: which devices hold which tile of a tensor (a `rich` table)."""
from __future__ import annotations

import re
from typing import List

import numpy as np
import torch

import torch_xla.runtime as xr


def _parse(sharding: str):
    """(tile grid of device lists) of a sharding text: `{devices=[2,2]0,1,2,3}`,
    `{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}`, `{replicated}`."""
    text = sharding.strip()
    if text in ("", "{replicated}"):
        n = xr.global_runtime_device_count()
        return np.array([[list(range(n))]], dtype=object)
    m = re.fullmatch(r"\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}", text)
    if m is None:
        raise ValueError(f"cannot read the sharding {sharding!r} (expected the '{{devices=[...]...}}' "
                         f"or '{{replicated}}' form)")
    dims = [int(d) for d in m.group(1).split(",")]
    devs = np.array([int(d) for d in m.group(2).split(",")]).reshape(dims)
    if m.group(3):
        tiles = devs.reshape(dims[:-1] + [dims[-1]])
        grid_dims = dims[:-1]
    else:
        tiles = devs.reshape(dims + [1])
        grid_dims = dims
    if len(grid_dims) > 2:
        if any(d != 1 for d in grid_dims[:-2]):
            raise ValueError(f"visualize_sharding shows at most 2 sharded dimensions, got {sharding!r}")
        grid_dims = grid_dims[-2:]
    grid_dims = ([1] * (2 - len(grid_dims))) + list(grid_dims)
    tiles = tiles.reshape(grid_dims + [-1])
    out = np.empty(grid_dims, dtype=object)
    for i in range(grid_dims[0]):
        for j in range(grid_dims[1]):
            out[i, j] = sorted(int(d) for d in tiles[i, j])
    return out


def visualize_sharding(sharding: str, use_color: bool = True,
                       scale: float = 1.0, min_width: int = 9,  # noqa: ARG001 (the original's; unused there too)
                       max_width: int = 80):
    """A `rich` table of the device tiles of a sharding text (printed, and returned), at most
    `max_width` columns wide. As in PyTorch/XLA, each cell fits its label: `scale` and
    `min_width`, from which the original computes cell sizes it never applies, change nothing."""
    import rich.align
    import rich.box
    import rich.console
    import rich.padding
    import rich.style
    import rich.table
    grid = _parse(sharding)
    console = rich.console.Console(width=max_width)
    color_on = use_color and bool(console.color_system)
    table = rich.table.Table(show_header=False, show_lines=not color_on, padding=0,
                             highlight=not color_on, pad_edge=False,
                             box=rich.box.SQUARE if not color_on else None)
    kind = xr.device_type() or "XLA"
    palette = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#31a354", "#e6550d"]
    for i in range(grid.shape[0]):
        cells = []
        for j in range(grid.shape[1]):
            devs: List[int] = grid[i, j]
            label = f"{kind} {devs[0]}" if len(devs) == 1 else f"{kind} {devs}"
            style = (rich.style.Style(bgcolor=palette[(i * grid.shape[1] + j) % len(palette)], color="white")
                     if color_on else rich.style.Style())
            cells.append(rich.padding.Padding(rich.align.Align(label, "center", vertical="middle"),
                                              (1, 1, 1, 1), style=style))
        table.add_row(*cells)
    console.print(table)
    return table


def visualize_tensor_sharding(t: torch.Tensor, **kwargs):
    """`visualize_sharding` of an xla tensor's current sharding."""
    from .xla_sharded_tensor import XLAShardedTensor, sharding_text
    g = t.global_tensor if isinstance(t, XLAShardedTensor) else t
    return visualize_sharding(sharding_text(g), **kwargs)

