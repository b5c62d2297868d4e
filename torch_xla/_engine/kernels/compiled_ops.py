"""Custom ops (`torch.ops.xla.*`) through which Dynamo graphs hold engine operations.

`xm.all_reduce` on one tensor inside `torch.compile` becomes `torch.ops.xla.all_reduce`:
Dynamo and aot_autograd trace it with the fake kernel (a tensor like the input) and the
compiled graph runs the xla kernel, the same collective IR node `xm.all_reduce` makes.
"""
from __future__ import annotations

import torch

ALL_REDUCE = "all_reduce(Tensor input, str reduce_type, float scale, int[][] groups) -> Tensor"


class _Engine:
    """`op`: `kernels.engine_op`, handed over by `register` (the package imports this
    module, not the reverse). Set once, at the import of torch_xla (under Python's import
    lock); read by any thread that runs a compiled graph's op."""
    __slots__ = ("op",)

    def __init__(self):
        self.op = None


_engine = _Engine()


def _all_reduce_xla(input, reduce_type, scale, groups):
    g = tuple(tuple(int(r) for r in grp) for grp in groups) or None
    (out,) = _engine.op("xla::all_reduce", [input], (reduce_type, float(scale), g), [(tuple(input.shape), input.dtype)])
    return out


def _all_reduce_fake(input, reduce_type, scale, groups):
    return torch.empty_like(input)


def register(library, engine_op) -> None:
    _engine.op = engine_op
    library.define("xla", ALL_REDUCE)
    library.impl_ns("xla", "all_reduce", _all_reduce_xla, "PrivateUse1")
    library.impl_ns("xla", "all_reduce", _all_reduce_fake, "Meta")
    register_mark_sharding(library)
    register_mark_tensor(library)
    register_buffer_donor(library)
    library.define("xla", DOT_GENERAL)
    library.impl_ns("xla", "dot_general", _dot_general_xla, "PrivateUse1")
    library.impl_ns("xla", "dot_general", _dot_general_fake, "Meta")


# One XLA DotGeneral without batch dimensions: `XLAPatchedLinear` contracts an N-d
# activation with a weight as one dot (an einsum or matmul would flatten it to 2-d with
# reshapes, which SPMD's sharding propagation cannot see through).
DOT_GENERAL = "dot_general(Tensor lhs, Tensor rhs, int[] lhs_contracting, int[] rhs_contracting) -> Tensor"


def _dot_shape(lhs, rhs, lc, rc):
    lc = [d % lhs.dim() for d in lc]
    rc = [d % rhs.dim() for d in rc]
    if [lhs.shape[d] for d in lc] != [rhs.shape[d] for d in rc]:
        raise RuntimeError(f"dot_general: contracting sizes differ: {list(lhs.shape)} dims {lc} vs "
                           f"{list(rhs.shape)} dims {rc}")
    return lc, rc, tuple(s for d, s in enumerate(lhs.shape) if d not in lc) + \
        tuple(s for d, s in enumerate(rhs.shape) if d not in rc)


def _dot_general_xla(lhs, rhs, lhs_contracting, rhs_contracting):
    lc, rc, shape = _dot_shape(lhs, rhs, lhs_contracting, rhs_contracting)
    dtype = torch.result_type(lhs, rhs)
    lhs, rhs = lhs.to(dtype), rhs.to(dtype)
    dn = ((tuple(lc), tuple(rc)), ((), ()))
    (out,) = _engine.op("xla::dot_general", [lhs, rhs], (dn, None), [(shape, dtype)])
    return out


def _dot_general_fake(lhs, rhs, lhs_contracting, rhs_contracting):
    lc, rc, shape = _dot_shape(lhs, rhs, lhs_contracting, rhs_contracting)
    return lhs.new_empty(shape, dtype=torch.result_type(lhs, rhs))


# A sharding constraint as a graph op: `MarkShardingFunction` under aot_autograd / export
# tracing records `torch.ops.xla.mark_sharding` (the layout is its string argument, made
# by `sharding.layout_key`), and running the graph applies it on the device.
MARK_SHARDING = "mark_sharding(Tensor input, str layout) -> Tensor"


def _mark_sharding_xla(input, layout):
    from .. import partitioning
    sh = partitioning.from_layout_key(layout)
    (out,) = _engine.op("xla::sharding_constraint", [input], (sh,), [(tuple(input.shape), input.dtype)])
    return out


def _mark_sharding_fake(input, layout):
    return torch.empty_like(input)


def register_mark_sharding(library) -> None:
    library.define("xla", MARK_SHARDING)
    library.impl_ns("xla", "mark_sharding", _mark_sharding_xla, "PrivateUse1")
    library.impl_ns("xla", "mark_sharding", _mark_sharding_fake, "Meta")


# A composite pattern's boundary (`torch_xla.experimental.mark_pattern_utils`): on the xla
# device an `xla::mark_tensor` node that StableHLO lowering groups into a composite op
# (`executor/composites.py`); elsewhere a copy, as on the device (the marked value is a
# new tensor: writing to it leaves the original alone).
MARK_TENSOR = "mark_tensor(Tensor x, str name, int pos, str id, bool is_input, Any? attr=None) -> Tensor"


def check_composite_attr(attr) -> None:
    """Raises ValueError unless `attr` is None or (key, value) pairs with str keys and
    str / float / int / bool values or lists of one of float / int / bool."""
    if attr is None:
        return
    for kv in attr:
        if not (isinstance(kv, (tuple, list)) and len(kv) == 2 and isinstance(kv[0], str)):
            raise ValueError("Composite attr name must be a Python str.")
        v = kv[1]
        if isinstance(v, (list, tuple)):
            kinds = {type(e) for e in v}
            ok = len(kinds) == 1 and next(iter(kinds)) in (int, float, bool)
        else:
            ok = type(v) in (str, float, int, bool)
        if not ok:
            raise ValueError("Composite attr value must be either Python str, float, int, bool, list[int], "
                             "list[float], list[bool].")


def _freeze_attr(attr):
    return None if attr is None else tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in attr)


def _mark_tensor_xla(x, name, pos, id, is_input, attr=None):
    check_composite_attr(attr)
    (out,) = _engine.op("xla::mark_tensor", [x], (name, int(pos), id, bool(is_input), _freeze_attr(attr)),
                           [(tuple(x.shape), x.dtype)])
    return out


def _mark_tensor_other(x, name, pos, id, is_input, attr=None):
    check_composite_attr(attr)
    return x.clone()


def _mark_tensor_fake(x, name, pos, id, is_input, attr=None):
    return torch.empty_like(x)


def register_mark_tensor(library) -> None:
    library.define("xla", MARK_TENSOR)
    library.impl_ns("xla", "mark_tensor", _mark_tensor_xla, "PrivateUse1")
    library.impl_ns("xla", "mark_tensor", _mark_tensor_other, "CompositeExplicitAutograd")
    library.impl_ns("xla", "mark_tensor", _mark_tensor_fake, "Meta")


# A buffer donation inside a compiled function: `torch.ops.xla.dynamo_set_buffer_donor_(t, True)`
# marks `t`'s device buffer as a donor (`_XLAC._set_buffer_donation`) when the graph is
# traced, so the program compiled for it donates that input at every run. The result is a
# new tensor of the same value (a custom op's output may not alias its input: aot_autograd
# checks it and refuses under `TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING` / `CI`); on the
# xla device that clone is a new tensor over the same IR value, no graph node. The op is
# registered as side-effecting so that graph passes keep it when its result is unused.
BUFFER_DONOR = "dynamo_set_buffer_donor_(Tensor t, bool should_donate) -> Tensor"


def _set_buffer_donor_xla(t, should_donate):
    from ..executor import donation
    donation.set_donor(t, bool(should_donate))
    return t.clone()


def _set_buffer_donor_other(t, should_donate):
    return t.clone()


def register_buffer_donor(library) -> None:
    library.define("xla", BUFFER_DONOR)
    library.impl_ns("xla", "dynamo_set_buffer_donor_", _set_buffer_donor_xla, "PrivateUse1")
    library.impl_ns("xla", "dynamo_set_buffer_donor_", _set_buffer_donor_other, "CompositeExplicitAutograd")
    # Its result is usually unused: without this, FX dead-code elimination drops the call.
    import torch.fx.node
    torch.fx.node.has_side_effect(torch.ops.xla.dynamo_set_buffer_donor_.default)
