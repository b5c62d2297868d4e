"""`xs.mark_sharding` inside `torch.compile`: an op of the graph, not a graph break.

Dynamo skips `torch_xla.distributed.spmd` (a call into it is a graph break, the
annotation then runs between two programs). `mark_sharding` gets a stand-in that Dynamo
traces instead (`torch.compiler.substitute_in_graph`): the same annotation as
`torch.ops.xla.dynamo_mark_sharding`, so an activation is laid out inside the compiled
program. The stand-in lives here, outside the skipped package, for Dynamo to trace it.
Inside a compiled function it returns the annotated tensor itself (no `XLAShardedTensor`).
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np
import torch

from torch_xla._engine import process_patches as _process_patches


class _Registration:
    """`fn`: the `mark_sharding` to stand in for; `done`: registered with Dynamo (once per
    process). Both set under the import lock, by the thread importing the spmd package or
    torch._dynamo."""
    __slots__ = ("fn", "done")

    def __init__(self):
        self.fn = None
        self.done = False


_reg = _Registration()


def _register() -> None:
    if _reg.done or _reg.fn is None:
        return
    _reg.done = True
    import torch._dynamo as dynamo

    @dynamo.assume_constant_result
    def layout_args(mesh, partition_spec):
        # The mesh and spec as the op's plain arguments, computed once per compile (the
        # mesh object is guarded on).
        return (np.asarray(mesh.device_ids).reshape(-1).tolist(), list(mesh.mesh_shape), str(mesh.axis_names),
                str(tuple(partition_spec)))

    @dynamo.substitute_in_graph(_reg.fn)
    def mark_sharding(t, mesh, partition_spec):
        device_ids, mesh_shape, axis_names, spec = layout_args(mesh, partition_spec)
        torch.ops.xla.dynamo_mark_sharding(t, device_ids, mesh_shape, axis_names, spec)
        return t


class _AfterDynamo(_process_patches._OneShotImportHook):
    """Registers the stand-in right after torch._dynamo loads."""
    NAME = "torch._dynamo"

    def around(self, run, module) -> None:
        run(module)
        _register()


def set_target(mark_sharding: Callable) -> None:
    """The `mark_sharding` that `install` gives a stand-in."""
    _reg.fn = mark_sharding


def install() -> None:
    """Patch `mark_sharding_in_graph`: registers the stand-in with Dynamo, now if Dynamo is
    loaded, else once it loads (importing it costs seconds: not done for this), and keeps
    `xla::dynamo_mark_sharding` in FX graphs when its result is unused."""
    from torch_xla._engine.kernels import library
    library.side_effectful("xla", "dynamo_mark_sharding")
    if "torch._dynamo" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterDynamo) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamo())
