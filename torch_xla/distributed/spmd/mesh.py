"""Device meshes and the vocabulary of layouts: `Mesh`, `HybridMesh`, `ShardingType`.

A `Mesh` lays device ids out in a logical n-d array with named axes; a partition spec
says, per tensor dimension, which mesh axes (by index or name, or a tuple of them)
split it, `None` for none.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch

import torch_xla.runtime as xr
from torch_xla._engine import telemetry as _metrics
from torch_xla._engine import partitioning as _sh


PartitionSpec = Tuple[Union[int, str, None, Tuple[Union[int, str], ...]], ...]


class ShardingError(ValueError, AssertionError):
    """A mesh or partition spec that cannot describe a layout of this job's devices."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ShardingError(msg)


class Mesh:
    """A logical mesh of devices: `device_ids` laid out row-major in `mesh_shape`.

    Ids index `xr.global_runtime_device_attributes()`. `axis_names` (optional) names the
    mesh axes for partition specs; without them, specs use axis indices.

        >>> mesh = Mesh(np.arange(8), (4, 2), ('data', 'model'))
        >>> mesh.shape()
        OrderedDict([('data', 4), ('model', 2)])
    """

    device_ids: np.ndarray
    mesh_shape: Tuple[int, ...]
    axis_names: Optional[Tuple[str, ...]]

    def __init__(self, device_ids: Union[np.ndarray, Sequence[int]], mesh_shape: Tuple[int, ...],
                 axis_names: Optional[Tuple[str, ...]] = None):
        device_ids = np.asarray(device_ids)
        mesh_shape = tuple(int(s) for s in mesh_shape)
        n = xr.global_runtime_device_count()
        _check(n > 0, "a mesh needs XLA devices")
        _check(len(device_ids) == n, f"Number of device IDs ({len(device_ids)}) must match the global "
                                     f"number of devices ({n})")
        if axis_names is not None:
            axis_names = tuple(axis_names)
            _check(len(axis_names) == len(mesh_shape),
                   f"Number of axis names ({len(axis_names)}) must match mesh dimensions ({len(mesh_shape)})")
            _check(len(set(axis_names)) == len(axis_names), f"Axis names must be unique, got: {axis_names}")
        size = math.prod(mesh_shape)
        _check(len(device_ids) == size,
               f"Number of device IDs ({len(device_ids)}) must match mesh size ({size})")
        _check(len(np.unique(device_ids)) == len(device_ids), f"Device IDs must be unique, got: {device_ids}")
        _check(all(0 <= int(d) < size for d in device_ids),
               f"Device IDs must be less than mesh size ({size}), got: {device_ids}")
        self.device_ids = device_ids
        self.mesh_shape = mesh_shape
        self.axis_names = axis_names
        self._jax = None
        self._shardings = {}  # partition spec -> NamedSharding (equal layouts, equal graph keys)

    def size(self) -> int:
        return int(math.prod(self.mesh_shape))

    def shape(self) -> "OrderedDict":
        keys = self.axis_names if self.axis_names is not None else range(len(self.mesh_shape))
        return OrderedDict(zip(keys, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: str) -> Optional[int]:
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def _jax_names(self) -> Tuple[str, ...]:
        return self.axis_names if self.axis_names is not None else tuple(
            f"_axis{i}" for i in range(len(self.mesh_shape)))

    def get_jax_mesh(self):
        """The `jax.sharding.Mesh` of the same devices and axes."""
        if self._jax is None:
            self._jax = _sh.jax_mesh(self.device_ids, self.mesh_shape, self._jax_names())
        return self._jax

    def _axis(self, a: Union[int, str]) -> str:
        names = self._jax_names()
        if isinstance(a, str):
            if self.axis_names is None or a not in self.axis_names:
                raise ShardingError(f"mesh axis {a!r} is not in the mesh's axis names {self.axis_names}")
            return a
        if isinstance(a, (int, np.integer)) and 0 <= int(a) < len(names):
            return names[int(a)]
        raise ShardingError(f"mesh axis {a!r} is out of range for a mesh of {len(names)} dimensions")

    def jax_spec(self, partition_spec: PartitionSpec) -> tuple:
        """A partition spec in jax's terms (axis names, tuples of them, None)."""
        out, used = [], []
        for entry in partition_spec:
            if entry is None:
                out.append(None)
                continue
            axes = tuple(self._axis(a) for a in (entry if isinstance(entry, (tuple, list)) else (entry,)))
            used.extend(axes)
            out.append(axes if len(axes) > 1 else axes[0])
        _check(len(set(used)) == len(used), f"a mesh axis is used twice in the partition spec {partition_spec}")
        return tuple(out)

    def sharding(self, partition_spec: PartitionSpec):
        """The jax NamedSharding of `partition_spec` over this mesh (made once per spec)."""
        key = tuple(tuple(e) if isinstance(e, list) else e for e in partition_spec)
        sh = self._shardings.get(key)
        if sh is None:
            sh = self._shardings[key] = _sh.named_sharding(self.get_jax_mesh(), self.jax_spec(partition_spec))
            _metrics.inc("CreateOpSharding")
        return sh

    def get_op_sharding(self, partition_spec: PartitionSpec) -> "OpSharding":
        return OpSharding(self.sharding(partition_spec), len(partition_spec))

    def __str__(self) -> str:
        return (f"{{'device_ids': {self.device_ids.tolist()}, 'mesh_shape': {self.mesh_shape}, "
                f"'axis_names': {self.axis_names}}}")

    __repr__ = __str__

    @classmethod
    def from_str(cls, mesh_str: str) -> Optional["Mesh"]:
        """The mesh printed by `str(mesh)`, or None when the text is not one."""
        import ast
        try:
            d = ast.literal_eval(mesh_str)
            return cls(np.array(d["device_ids"]), tuple(d["mesh_shape"]), d["axis_names"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None

    def __eq__(self, other) -> bool:
        return (isinstance(other, Mesh) and self.mesh_shape == other.mesh_shape
                and self.axis_names == other.axis_names and np.array_equal(self.device_ids, other.device_ids))

    def __hash__(self) -> int:
        return hash((tuple(self.device_ids.tolist()), self.mesh_shape, self.axis_names))


@dataclass(frozen=True)
class OpSharding:
    """A concrete sharding (the original's `torch_xla._XLAC.OpSharding`): jax sharding + rank."""
    jax_sharding: Any
    ndim: int

    def __str__(self) -> str:
        return _sh.spec_text(self.jax_sharding, self.ndim)


_global = {"mesh": None}


def set_global_mesh(mesh: Mesh) -> None:
    """Sets the mesh used where none is given (`get_global_mesh`)."""
    _global["mesh"] = mesh


def get_global_mesh() -> Optional[Mesh]:
    return _global["mesh"]


def get_1d_mesh(axis_name: Optional[str] = None) -> Mesh:
    """A mesh of all devices along one axis."""
    n = xr.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), None if axis_name is None else (axis_name,))


class HybridMesh(Mesh):
    """A mesh over hosts (DCN) and the devices within each host (ICI).

    The mesh shape is `ici_mesh_shape * dcn_mesh_shape` elementwise; devices of one host
    (a jax process) stay together along the ICI part of each axis, so collectives over
    an ICI axis never leave the host. On one host `dcn_mesh_shape` is all ones.
    """

    def __init__(self, *, ici_mesh_shape: Tuple[int, ...], dcn_mesh_shape: Optional[Tuple[int, ...]] = None,
                 axis_names: Optional[Tuple[str, ...]] = None):
        ici = tuple(int(s) for s in ici_mesh_shape)
        dcn = tuple(int(s) for s in dcn_mesh_shape) if dcn_mesh_shape is not None else (1,) * len(ici)
        _check(len(ici) == len(dcn), f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} differ in length")
        self.ici_mesh_shape, self.dcn_mesh_shape = ici, dcn
        # Granules: TPU slices where devices have a slice index, else hosts (processes).
        # Within one, devices in physical order (coordinates, last axis slowest), else by id.
        attrs = xr.global_runtime_device_attributes()
        key = "slice_index" if "slice_index" in attrs[0] else "process_index"
        if key == "slice_index" and math.prod(dcn) == 1 and len({a[key] for a in attrs}) > 1:
            raise ValueError("provide dcn_mesh_shape to make a mesh over several slices")
        granules = sorted({a.get(key, 0) for a in attrs})
        _check(math.prod(dcn) == len(granules),
               f"dcn_mesh_shape {dcn} has {math.prod(dcn)} hosts/slices, the job has {len(granules)}")

        def order(a):
            return (tuple(reversed(a.get("coords", ()))), a.get("core_on_chip", 0), _device_id(a))
        per_host = [[_device_id(a) for a in sorted((a for a in attrs if a.get(key, 0) == g), key=order)]
                    for g in granules]
        _check(all(len(p) == math.prod(ici) for p in per_host),
               f"ici_mesh_shape {ici} needs {math.prod(ici)} devices per host, hosts have "
               f"{[len(p) for p in per_host]}")
        # Blocks: host grid (dcn) of device grids (ici), interleaved axis by axis.
        grid = np.array([np.array(p).reshape(ici) for p in per_host]).reshape(dcn + ici)
        nd = len(ici)
        order = [a for i in range(nd) for a in (i, nd + i)]
        ids = grid.transpose(order).reshape(tuple(i * d for i, d in zip(ici, dcn)))
        super().__init__(ids.reshape(-1), tuple(i * d for i, d in zip(ici, dcn)), axis_names)


def _device_id(attrs: dict) -> int:
    """The logical id in a device's name ('TPU:3' -> 3)."""
    return int(str(attrs["name"]).rsplit(":", 1)[-1])


class ShardingType(IntEnum):
    """The kind of a sharding (values of XLA's OpSharding.Type)."""
    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


def sharding_type_of(jax_sharding, ndim: int) -> Optional[ShardingType]:
    if jax_sharding is None:
        return None
    hs = jax_sharding._to_xla_hlo_sharding(ndim)
    if hs.is_replicated():
        return ShardingType.REPLICATED
    if hs.is_manual():
        return ShardingType.MANUAL
    if hs.is_maximal():
        return ShardingType.MAXIMAL
    return ShardingType.PARTIAL if hs.replicate_on_last_tile_dim() else ShardingType.TILED


def xla_mesh(device_mesh) -> Mesh:
    """A `Mesh` of the same device ids and shape as a torch `DeviceMesh` (or a Mesh)."""
    if isinstance(device_mesh, Mesh):
        return device_mesh
    ids = device_mesh.mesh.cpu().numpy() if isinstance(device_mesh.mesh, torch.Tensor) else np.asarray(device_mesh.mesh)
    names = getattr(device_mesh, "mesh_dim_names", None)
    return Mesh(ids.reshape(-1), tuple(ids.shape), tuple(names) if names else None)


def split_placements(placements: Sequence, ndim: int, mesh_ndim: int) -> Tuple[tuple, Tuple[Tuple[int, str], ...]]:
    """The partition spec of the Shard / Replicate placements and the Partial ones as
    (mesh dim, reduce op) pairs."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
    if len(placements) != mesh_ndim:
        raise ValueError(f"Number of placements ({len(placements)}) must match mesh dimensions ({mesh_ndim})")
    spec = [None] * ndim
    partial = []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + ndim
            if not 0 <= d < ndim:
                raise IndexError(f"Shard dimension {p.dim} is out of bounds for a tensor of {ndim} dimensions")
            if spec[d] is None:
                spec[d] = mesh_dim
            else:
                prev = spec[d] if isinstance(spec[d], tuple) else (spec[d],)
                spec[d] = prev + (mesh_dim,)
        elif isinstance(p, Partial):
            partial.append((mesh_dim, p.reduce_op))
        elif not isinstance(p, Replicate):
            raise ValueError(f"unknown placement {p!r}")
    ops = {op for _, op in partial}
    if len(ops) > 1 and ops != {"sum", "avg"}:  # sum and avg commute; other mixes depend on order
        raise ValueError(f"Mixed Partial reduce types are not supported in the same placement list. "
                         f"Found reduce ops: {ops}. Please ensure all Partial placements use the same "
                         f"reduce operation.")
    return tuple(spec), tuple(partial)
