"""SPMD: one program over every device, partitioned by XLA from sharding annotations.

In SPMD mode the process has one logical device, `xla:0`, over all devices of the job.
Device data is a global `jax.Array`: replicated over every device unless annotated. An
annotation (`mark_sharding`) is a `jax.sharding.NamedSharding`; it reshards device data
at once, and becomes a sharding constraint inside the graph for a pending value. The
program strategy (`executor/strategies.Spmd`) compiles each graph once for the
shardings of its inputs (they are part of the graph key) and lets XLA's partitioner
place everything else.

Annotations ride on the tensor the user annotated (functionalization swaps the inner
tensor of an in-place op; the user's tensor object stays), and every barrier re-applies
them to annotated tensors whose value is pending, so a parameter keeps its sharding
through optimizer steps.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import boot, env_vars, ir, job, mode, pjrt, tensor as _tensor
from .lowering import LOWERINGS

ANNOTATION = "_xla_sharding"  # attribute of an annotated tensor: its NamedSharding
# id -> weak reference of every annotated tensor (tensors compare elementwise: no WeakSet).
_annotated: Dict[int, "weakref.ref"] = {}


class _Devices:
    """The job's devices as SPMD sees them. `devices` (logical order) and `logical` (jax
    device -> logical id): computed by the first thread that asks, without a lock (a race
    computes the same values twice; `logical` is stored first, so a thread that sees
    `devices` sees it too). `replicated`: SPMD's default placement, set by `enable` in the
    thread that turns SPMD on (the user's, or the one that started jax). Read by any thread."""
    __slots__ = ("replicated", "devices", "logical")

    def __init__(self):
        self.replicated = None
        self.devices = None
        self.logical = None


_devices = _Devices()


# ---- mode ---------------------------------------------------------------------------------

def enable() -> None:
    """Turns SPMD mode on for this process (idempotent)."""
    if mode.modes.spmd:
        return
    pjrt.jax_module()  # may enable SPMD itself (XLA_USE_SPMD, boot's after_start)
    if mode.modes.spmd:
        return
    if job.in_launched_child():
        raise RuntimeError(
            "xr.use_spmd() cannot be mixed with the multi-process replication API "
            "(torch_xla.launch / xmp.spawn): SPMD runs one program over all devices from one "
            "process per host")
    decided = _tensor.decided_index.value
    if decided:
        # A replica of a CPU job named its device xla:<rank> before SPMD was asked for;
        # SPMD's one logical device is xla:0.
        if _tensor.tensors_made():
            raise RuntimeError(f"xr.use_spmd() must come before this process's first xla tensor: its "
                               f"tensors are on xla:{decided}, while SPMD's one device is xla:0")
        _tensor.set_device_index(None)
    mode.modes.spmd = True
    ir.DeviceData.shard_aware = True
    ir.upload_host_data_on_use()
    rep = _devices.replicated = replicated_sharding()
    pjrt.set_placement(rep)


def _from_environment() -> None:
    if env_vars.get("XLA_USE_SPMD"):
        enable()


boot.after_start.append(_from_environment)


def global_devices() -> list:
    """Every device of the job, host by host: logical device i is `global_devices()[i]`
    (jax's own ids need not be 0..n-1: a second host's CPU devices start at 2048)."""
    if _devices.devices is None:
        jax = pjrt.jax_module()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        _devices.logical = {d: i for i, d in enumerate(devices)}
        _devices.devices = devices
    return _devices.devices


def logical_id(device) -> int:
    """The logical id (position in `global_devices()`) of a jax device."""
    global_devices()
    return _devices.logical[device]


def replicated_sharding():
    """Replicated over every device (the default placement of SPMD device data).

    Not a NamedSharding on a mesh of our own: jax expresses a program's outputs on the
    mesh of its first named input, and a private 1-d mesh cannot express the layouts of
    the user's meshes."""
    if _devices.replicated is not None:
        return _devices.replicated
    return gspmd(None, global_devices())


def gspmd(sharding, devices=None, ndim: int = 0):
    """The mesh-free (GSPMD) form of `sharding`; replicated over `devices` when None."""
    from jax._src.sharding_impls import GSPMDSharding
    if sharding is None:
        return GSPMDSharding.get_replicated(tuple(devices))
    return GSPMDSharding(sharding._device_assignment, sharding._to_xla_hlo_sharding(ndim))


# ---- meshes and shardings -------------------------------------------------------------------

def jax_mesh(device_ids: Sequence[int], mesh_shape: Tuple[int, ...], axis_names: Tuple[str, ...]):
    """The jax `Mesh` of logical device ids laid out in `mesh_shape`."""
    from jax.sharding import Mesh
    every = global_devices()
    devs = np.array([every[int(i)] for i in np.asarray(device_ids).reshape(-1)],
                    dtype=object).reshape(mesh_shape)
    return Mesh(devs, tuple(axis_names))


def named_sharding(mesh, spec: Tuple):
    """A NamedSharding of `mesh` (a jax Mesh) for a spec of axis names / tuples / None."""
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(mesh, PartitionSpec(*spec))


def is_replicated(sharding) -> bool:
    return bool(getattr(sharding, "is_fully_replicated", False))


def divisible(sharding, shape: Tuple[int, ...]) -> bool:
    """Whether every sharded dimension of `shape` splits evenly (a jax.Array can hold it)."""
    parts = dim_parts(sharding, len(shape))
    return all(n % p == 0 for n, p in zip(shape, parts))


def _axes_per_dim(sharding, ndim: int) -> List[tuple]:
    """The mesh axes that cut each dimension, for a NamedSharding."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in spec[:ndim]]


def dim_parts(sharding, ndim: int) -> List[int]:
    """How many pieces each dimension is cut into."""
    if not hasattr(sharding, "mesh"):
        hs = sharding._to_xla_hlo_sharding(ndim)
        if hs.is_replicated():
            return [1] * ndim
        return list(hs.tile_assignment_dimensions())[:ndim]
    mesh = sharding.mesh
    return [math.prod(mesh.shape[a] for a in axes) for axes in _axes_per_dim(sharding, ndim)]


def shard_layout(sharding, shape: Tuple[int, ...]):
    """Per device, in logical id order: (device, index slices, replica id, padded shape).

    Uneven dimensions are cut in pieces of ceil(n / parts); the last pieces are padded
    (and may be empty), as XLA pads them inside a partitioned program."""
    if not hasattr(sharding, "mesh"):
        return _layout_of_array_sharding(sharding, shape)
    mesh = sharding.mesh
    names = list(mesh.axis_names)
    dims = _axes_per_dim(sharding, len(shape))
    used = {a for axes in dims for a in axes}
    free = [a for a in names if a not in used]
    out = []
    for coords in np.ndindex(*mesh.devices.shape):
        dev = mesh.devices[coords]
        at = dict(zip(names, coords))
        index, padded = [], []
        for n, axes in zip(shape, dims):
            parts = math.prod(mesh.shape[a] for a in axes)
            k = 0
            for a in axes:
                k = k * mesh.shape[a] + at[a]
            chunk = -(-n // parts) if parts else n
            start = min(k * chunk, n)
            index.append(slice(start, min(start + chunk, n), 1))
            padded.append(chunk)
        rep = 0
        for a in free:
            rep = rep * mesh.shape[a] + at[a]
        out.append((dev, tuple(index), rep, tuple(padded)))
    out.sort(key=lambda r: logical_id(r[0]))
    return out


def _layout_of_array_sharding(sharding, shape: Tuple[int, ...]):
    """`shard_layout` of a mesh-free sharding (an array's own: even pieces)."""
    parts = dim_parts(sharding, len(shape))
    padded = tuple(-(-n // p) for n, p in zip(shape, parts))
    seen = {}
    out = []
    for dev, index in sorted(sharding.devices_indices_map(tuple(shape)).items(), key=lambda kv: logical_id(kv[0])):
        index = tuple(slice(s.start or 0, n if s.stop is None else s.stop, 1) for s, n in zip(index, shape))
        key = tuple((s.start, s.stop) for s in index)
        rep = seen[key] = seen.get(key, -1) + 1
        out.append((dev, index, rep, padded))
    return out


def spec_text(sharding, ndim: int) -> str:
    """The HLO sharding text: `{devices=[4,1]0,1,2,3}`, `{replicated}`, `... last_tile_dim_replicate}`."""
    if sharding is None:
        return ""
    hs = sharding._to_xla_hlo_sharding(ndim)
    if hs.is_replicated():
        return "{replicated}"
    if hs.is_manual():
        return "{manual}"
    dims = hs.tile_assignment_dimensions()
    # The tile assignment indexes the sharding's device assignment; print device ids.
    assignment = sharding._device_assignment
    devs = [logical_id(assignment[i]) for i in hs.tile_assignment_devices()]
    tail = " last_tile_dim_replicate" if hs.replicate_on_last_tile_dim() else ""
    return "{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, devs)) + tail + "}"


# ---- device data --------------------------------------------------------------------------

def put(host: np.ndarray, sharding):
    """Host data placed with `sharding` (replicated when the layout is uneven)."""
    jax = pjrt.jax_module()
    if not divisible(sharding, host.shape):
        sharding = replicated_sharding()
    return jax.device_put(host, sharding)


def reshard(array, sharding):
    """Device data laid out with `sharding` (replicated when the layout is uneven)."""
    jax = pjrt.jax_module()
    if not divisible(sharding, tuple(array.shape)):
        sharding = replicated_sharding()
    if type(array) is pjrt.HostArray:
        return array.place(sharding)
    if array.sharding == sharding:
        return array
    return jax.device_put(array, sharding)


def on_mesh(array):
    """`array` on every device: data placed before SPMD mode moves to the replicated layout."""
    if type(array) is pjrt.HostArray:
        return array
    if len(array.sharding.device_set) == 1 and len(global_devices()) > 1:
        return reshard(array, replicated_sharding())
    return array


# ---- annotations -----------------------------------------------------------------------------

def annotation(t) -> Optional[object]:
    """The sharding annotated on `t` (or its inner tensor), if any."""
    s = getattr(t, ANNOTATION, None)
    if s is None and _tensor.is_functional(t):
        s = getattr(_tensor.unwrap(t), ANNOTATION, None)
    return s


def _unary_node(state, op: str, args: tuple, shape) -> ir.Node:
    """Engine op `op` on the value of `state`, with static `args`, giving `shape`."""
    return ir.Node(op, ((state.node, state.idx),), (ir.ref(0),) + args, ((tuple(shape), state.dtype),),
                   LOWERINGS[op], None)


def constraint_node(state, sharding) -> ir.Node:
    return _unary_node(state, "xla::sharding_constraint", (sharding,), state.shape)


def annotate(t, sharding, in_graph: bool = False) -> None:
    """Annotates tensor `t`: device data is resharded now, a pending value is constrained
    (`in_graph`: device data too, as a constraint in the next graph)."""
    setattr(t, ANNOTATION, sharding)
    key = id(t)
    _annotated[key] = weakref.ref(t, lambda _r, k=key: _annotated.pop(k, None))
    inner = _tensor.unwrap(t)
    if inner is not t:
        setattr(inner, ANNOTATION, sharding)
    s = inner._xla
    if type(s.node) is ir.DeviceData and not in_graph:
        arr = reshard(on_mesh(s.node.array), sharding)
        s.set_data(ir.DeviceData(arr, (s.shape, s.dtype)))
    else:
        _tensor.point_at(s, _tensor.XlaState(constraint_node(s, sharding), 0, s.shape, s.dtype))


def clear(t) -> None:
    """Drops the annotation of `t`; its data goes back to the replicated layout."""
    for x in (t, _tensor.unwrap(t)):
        if hasattr(x, ANNOTATION):
            delattr(x, ANNOTATION)
    _annotated.pop(id(t), None)
    s = _tensor.unwrap(t)._xla
    if type(s.node) is ir.DeviceData:
        s.set_data(ir.DeviceData(reshard(s.node.array, replicated_sharding()), (s.shape, s.dtype)))
    elif s.node.op == "xla::sharding_constraint":
        o, i = s.node.operands[0]
        s.node, s.idx = o, i


def constrain_annotated() -> None:
    """Before a barrier: annotated tensors whose value is pending keep their sharding."""
    if not _annotated:
        return
    for r in list(_annotated.values()):
        t = r()
        sh = getattr(t, ANNOTATION, None) if t is not None else None
        if sh is None:
            continue
        try:
            inner = _tensor.unwrap(t)
            s = inner._xla
        except (AttributeError, RuntimeError):
            continue
        if tuple(inner.shape) != s.shape:
            continue
        node = s.node
        if type(node) is ir.DeviceData or type(node) is ir.ScalarParam or type(node) is ir.Constant:
            continue
        if node.op == "xla::sharding_constraint" and node.args[1] == sh:
            continue
        _tensor.point_at(s, _tensor.XlaState(constraint_node(s, sh), 0, s.shape, s.dtype))


def data_sharding(t):
    """The sharding of `t`'s device data, or None while its value is pending."""
    s = _tensor.state_of(t)
    if type(s.node) is ir.DeviceData:
        return s.node.array.sharding
    if s.node.op == "xla::sharding_constraint":
        return s.node.args[1]
    return None


def layout_key(device_ids, mesh_shape, axis_names, spec) -> str:
    """A NamedSharding as text (the argument of the graph op `xla::mark_sharding`)."""
    import json

    def entry(e):
        return list(e) if isinstance(e, tuple) else e
    return json.dumps({"ids": [int(i) for i in np.asarray(device_ids).reshape(-1)],
                       "shape": [int(s) for s in mesh_shape], "names": list(axis_names),
                       "spec": [entry(e) for e in spec]})


_from_key: Dict[str, object] = {}


def from_layout_key(key: str):
    """The NamedSharding of a `layout_key` text (made once per text)."""
    sh = _from_key.get(key)
    if sh is None:
        import json
        d = json.loads(key)
        mesh = jax_mesh(d["ids"], tuple(d["shape"]), tuple(d["names"]))
        spec = tuple(tuple(e) if isinstance(e, list) else e for e in d["spec"])
        sh = _from_key[key] = named_sharding(mesh, spec)
    return sh


def set_array(t, array) -> None:
    """Makes `array` (laid out as it is) the value of xla tensor `t`."""
    s = _tensor.unwrap(t)._xla
    s.set_data(ir.DeviceData(array, (s.shape, s.dtype)))


# ---- manual regions ----------------------------------------------------------------------------
#
# Between `full_to_shard` (or `mark_manual`) and `shard_to_full` the program is written per
# device: each device sees its own piece. The executor lowers each such region as a
# `shard_map` over the mesh (`executor/manual.py`).

MANUAL = "_xla_manual"  # attribute of a tensor whose value is per-device (inside a region)


class _ManualRegions:
    """`used`: a manual region was ever started, so the barrier checks its roots for
    per-device values. Set (never cleared) by the tracing thread that starts one, without
    a lock; read by the barrier's thread (under `barrier._lock`)."""
    __slots__ = ("used",)

    def __init__(self):
        self.used = False


manual_regions = _ManualRegions()


def _new(state, op: str, args: tuple, shape):
    manual_regions.used = True
    node = _unary_node(state, op, args, shape)
    return _tensor.wrap_user(_tensor.make_tensor(node, 0, tuple(shape), state.dtype))


def is_manual(t) -> bool:
    return getattr(t, MANUAL, False) or (_tensor.is_functional(t) and getattr(_tensor.unwrap(t), MANUAL, False))


def full_to_shard(t):
    """The piece of `t` each device holds under its annotation, as a per-device value."""
    sh = annotation(t)
    if sh is None or not hasattr(sh, "mesh"):
        raise RuntimeError("full_to_shard: the tensor has no sharding annotation (mark_sharding it first)")
    shape = tuple(t.shape)
    if not divisible(sh, shape):
        raise RuntimeError(f"a manual sharding region needs every sharded dimension to split evenly: shape "
                           f"{shape} over {dim_parts(sh, len(shape))} pieces")
    local = tuple(n // p for n, p in zip(shape, dim_parts(sh, len(shape))))
    out = _new(_tensor.state_of(t), "xla::full_to_shard", (sh,), local)
    setattr(out, MANUAL, True)
    return out


def mark_manual(t):
    """Declares pending value `t` per-device (each device's piece is what it computed)."""
    s = _tensor.state_of(t)
    if type(s.node) is ir.DeviceData:
        raise RuntimeError("_mark_manual_sharding: device data has a global layout already; only a value "
                           "computed inside a manual region can be marked manual")
    if is_manual(t):
        return t
    out = _new(s, "xla::manual", (), t.shape)
    setattr(out, MANUAL, True)
    return out


def shard_to_full(t, sharding, full_shape: Tuple[int, ...]):
    """The global value of `full_shape` whose pieces, laid out as `sharding`, are the
    per-device values of `t`."""
    if not is_manual(t):
        raise RuntimeError("shard_to_full: the tensor is not manually sharded (_mark_manual_sharding it, or "
                           "use disable_manual_sharding)")
    full_shape = tuple(int(d) for d in full_shape)
    parts = dim_parts(sharding, len(full_shape)) if len(full_shape) else []
    want = tuple(n // p for n, p in zip(full_shape, parts)) if parts else full_shape
    if tuple(t.shape) != want or any(n % p for n, p in zip(full_shape, parts)):
        raise RuntimeError(f"shard_to_full: per-device shape {tuple(t.shape)} does not make {full_shape} laid out "
                           f"in {parts} pieces")
    out = _new(_tensor.state_of(t), "xla::shard_to_full", (sharding, full_shape), full_shape)
    setattr(out, ANNOTATION, sharding)
    return out
