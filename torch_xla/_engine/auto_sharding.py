"""Automatic sharding (`xr.use_spmd(auto=True)`, or `XLA_AUTO_SPMD=1`).

XLA's own auto-sharding pass is not part of the CPU compiler jax ships (the option
`use_auto_spmd_partitioning` is accepted and ignored: every input stays replicated; with
Shardy the compiler aborts), so the shardings of a program's inputs are chosen here, by a
rule on each input's shape, and XLA's sharding propagation lays out everything else
(docs/auto_sharding.md):

- the mesh is `XLA_AUTO_SPMD_MESH` (`2,2`: a 2-by-2 mesh) or, unset, every device in one
  axis (`n,1`);
- inputs already laid out over the mesh (annotated with `mark_sharding`, or a program's
  sharded result) keep their layout;
- inputs smaller than `MIN_BYTES` (and 0-d ones) stay replicated: their pieces would save
  less memory than the collectives that gather them cost;
- a larger input is cut along its largest dimensions: each mesh axis, largest first, goes
  to the dimension with the largest extent per device among those it divides evenly (the
  first one on a tie, a batch dimension where it is the largest); an axis dividing none
  stays replicated.

The executor's `Spmd` strategy places each input accordingly before the program compiles
(`place`) and keeps the layout on the tensor's data, so later programs take it as it is
and the chosen layout is visible (`_get_xla_sharding_spec`). Programs compiled this way
have keys of their own (`key_name`: on/off and the mesh text) and are counted as
`CompileWithAutoSharding`.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

from . import boot, env_vars, ir, mode, partitioning, pjrt, telemetry

# Below this many bytes an input stays replicated.
MIN_BYTES = 16 * 1024


class _State:
    """`on`: set by `xr.use_spmd(auto=True)` in the user's thread; read by the barrier."""
    __slots__ = ("on",)

    def __init__(self):
        self.on = False


_state = _State()
_meshes: Dict[Tuple[int, ...], object] = {}


def enable() -> None:
    """Turns automatic sharding on (SPMD mode must be on: `xr.use_spmd`)."""
    _state.on = True


def disable() -> None:
    """Turns it off again (`XLA_AUTO_SPMD`, while set, keeps it on)."""
    _state.on = False


def enabled() -> bool:
    """Whether programs compile with automatically chosen input shardings."""
    return _state.on or bool(env_vars.get("XLA_AUTO_SPMD"))


def key_name() -> str:
    """The program strategy's name under automatic sharding: graphs compiled with it, and
    with each mesh, are distinct programs."""
    return "spmd-auto:" + env_vars.get("XLA_AUTO_SPMD_MESH").strip()


def count_compile() -> None:
    telemetry.inc("CompileWithAutoSharding")


def mesh_shape() -> Tuple[int, ...]:
    """The auto-sharding mesh: `XLA_AUTO_SPMD_MESH` (checked against the device count),
    default `(devices, 1)`."""
    n = len(partitioning.global_devices())
    text = env_vars.get("XLA_AUTO_SPMD_MESH").strip()
    if not text:
        return (n, 1)
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise RuntimeError(f"Invalid auto-sharding mesh_shape: {text} (XLA_AUTO_SPMD_MESH takes sizes "
                           f"separated by commas, e.g. 2,2)") from None
    if any(s < 1 for s in shape) or math.prod(shape) != n:
        raise RuntimeError(f"Invalid auto-sharding mesh_shape: {text} (its size must be the {n} devices)")
    return shape


def mesh():
    """The jax Mesh of `mesh_shape()` over the logical devices in order."""
    shape = mesh_shape()
    m = _meshes.get(shape)
    if m is None:
        m = _meshes[shape] = partitioning.jax_mesh(range(math.prod(shape)), shape,
                                                   tuple(f"auto{i}" for i in range(len(shape))))
    return m


def spec_for(shape: Tuple[int, ...], itemsize: int, mesh_shape: Tuple[int, ...]) -> Tuple:
    """The partition spec the rule gives an input of `shape` (axis names `auto<i>`):
    all None when it stays replicated."""
    ndim = len(shape)
    if ndim == 0 or math.prod(shape) * itemsize < MIN_BYTES:
        return (None,) * ndim
    parts = [1] * ndim
    axes = [[] for _ in range(ndim)]
    order = sorted((i for i, s in enumerate(mesh_shape) if s > 1), key=lambda i: -mesh_shape[i])
    for ax in order:
        size = mesh_shape[ax]
        best = None
        for d in range(ndim):
            if shape[d] % (parts[d] * size) == 0 and (best is None or shape[d] // parts[d] > shape[best] // parts[best]):
                best = d
        if best is not None:
            parts[best] *= size
            axes[best].append(f"auto{ax}")
    return tuple(None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in axes)


def choose(shape: Tuple[int, ...], itemsize: int):
    """The sharding the rule gives a replicated input of `shape`, or None (replicated)."""
    spec = spec_for(tuple(shape), itemsize, mesh_shape())
    if all(e is None for e in spec):
        return None
    return partitioning.named_sharding(mesh(), spec)


def place(leaf, array):
    """Program argument `array` laid out by the rule. When it is the data of parameter
    `leaf`, the leaf keeps the new layout, so the tensors holding it show it and later
    programs take it as it is."""
    given = array
    if type(array) is pjrt.HostArray:
        new = array.place(choose(array.shape, array.dtype.itemsize))
    else:
        array = partitioning.on_mesh(array)
        if not partitioning.is_replicated(array.sharding):
            return array
        sh = choose(tuple(array.shape), array.dtype.itemsize)
        new = array if sh is None else partitioning.reshard(array, sh)
    if new is not given and type(leaf) is ir.DeviceData and leaf.array is given:
        computed = leaf.computed
        # Re-made in place (every tensor holding the leaf sees it), its hash with the new
        # layout: a program compiled for it is not replayed on replicated data.
        ir.DeviceData.__init__(leaf, new, leaf.avals[0])
        leaf.computed = computed
        if new.sharding is not None and not partitioning.is_replicated(new.sharding):
            telemetry.inc("ReshardParameters")
    return new


def _from_environment() -> None:
    # XLA_AUTO_SPMD asks for SPMD mode too (`xr.is_spmd()` reads XLA_USE_SPMD).
    if env_vars.get("XLA_AUTO_SPMD") and not mode.modes.spmd:
        env_vars.update({"XLA_USE_SPMD": "1"})
        partitioning.enable()


boot.after_start.append(_from_environment)

