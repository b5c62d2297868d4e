"""Custom ops (`torch.ops.xla.*`) through which Dynamo graphs hold engine operations.

`xm.all_reduce` on one tensor inside `torch.compile` becomes `torch.ops.xla.all_reduce`:
Dynamo and aot_autograd trace it with the fake kernel (a tensor like the input) and the
compiled graph runs the xla kernel, the same collective IR node `xm.all_reduce` makes.
"""
from __future__ import annotations

import torch

ALL_REDUCE = "all_reduce(Tensor input, str reduce_type, float scale, int[][] groups) -> Tensor"
_engine_op = [None]   # kernels.engine_op, given by register()


def _all_reduce_xla(input, reduce_type, scale, groups):
    g = tuple(tuple(int(r) for r in grp) for grp in groups) or None
    (out,) = _engine_op[0]("xla::all_reduce", [input], (reduce_type, float(scale), g), [(tuple(input.shape), input.dtype)])
    return out


def _all_reduce_fake(input, reduce_type, scale, groups):
    return torch.empty_like(input)


def register(library, engine_op) -> None:
    _engine_op[0] = engine_op
    library.define("xla", ALL_REDUCE)
    library.impl_ns("xla", "all_reduce", _all_reduce_xla, "PrivateUse1")
    library.impl_ns("xla", "all_reduce", _all_reduce_fake, "Meta")
    register_mark_sharding(library)
    register_buffer_donor(library)


# A sharding constraint as a graph op: `MarkShardingFunction` under aot_autograd / export
# tracing records `torch.ops.xla.mark_sharding` (the layout is its string argument, made
# by `sharding.layout_key`), and running the graph applies it on the device.
MARK_SHARDING = "mark_sharding(Tensor input, str layout) -> Tensor"


def _mark_sharding_xla(input, layout):
    from .. import sharding
    sh = sharding.from_layout_key(layout)
    (out,) = _engine_op[0]("xla::sharding_constraint", [input], (sh,), [(tuple(input.shape), input.dtype)])
    return out


def _mark_sharding_fake(input, layout):
    return torch.empty_like(input)


def register_mark_sharding(library) -> None:
    library.define("xla", MARK_SHARDING)
    library.impl_ns("xla", "mark_sharding", _mark_sharding_xla, "PrivateUse1")
    library.impl_ns("xla", "mark_sharding", _mark_sharding_fake, "Meta")


# A buffer donation inside a compiled function: `torch.ops.xla.dynamo_set_buffer_donor_(t, True)`
# marks `t`'s device buffer as a donor (`_XLAC._set_buffer_donation`) when the graph is
# traced, so the program compiled for it donates that input at every run. Tensors of other
# devices (Dynamo's fake tensors) pass through unchanged.
BUFFER_DONOR = "dynamo_set_buffer_donor_(Tensor t, bool should_donate) -> Tensor"


def _set_buffer_donor_xla(t, should_donate):
    from ..executor import donation
    donation.set_donor(t, bool(should_donate))
    return t


def _set_buffer_donor_other(t, should_donate):
    return t


def register_buffer_donor(library) -> None:
    library.define("xla", BUFFER_DONOR)
    library.impl_ns("xla", "dynamo_set_buffer_donor_", _set_buffer_donor_xla, "PrivateUse1")
    library.impl_ns("xla", "dynamo_set_buffer_donor_", _set_buffer_donor_other, "CompositeExplicitAutograd")
