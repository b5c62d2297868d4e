"""Program strategies: how one graph becomes a program over this process's devices.

- `Local`: the graph as it is, on this process's device;
- `Replicated`: a graph holding a collective in a multi-process job, compiled as one SPMD
  program over the replica mesh (`shard_map` over axis 'r' of every process's device);
  each process feeds its own buffers as its shard.
- `Spmd` (`xr.use_spmd()`): the graph as it is, over every device; its inputs carry
  their shardings (part of the graph key) and XLA's partitioner places the rest.

A strategy wraps the graph's function, turns the local parameter buffers into the
program's arguments and its results back into local buffers, and says whether buffers
may be donated. The executor picks one per graph (`for_graph`).
"""
from __future__ import annotations

import numpy as np

from .. import auto_sharding, ir, job, mode, pjrt, partitioning
from ..lowering import ctx as lowering_ctx
from .graph import Graph


class Strategy:
    """The defaults: the graph's function as it is, its buffers as its arguments."""
    name = ""
    donates = True
    persistable = True  # its executables may be stored in the persistent cache
    execute_metric = "ExecuteTime"
    library_products = False  # its programs may call the platform's product handler (one device)

    def jit_options(self, graph: Graph, args) -> dict:
        """Extra `jax.jit` arguments for this graph."""
        return {}

    def compiled(self) -> None:
        """Called once per program compiled with this strategy (not for text dumps)."""

    def retry_options(self, graph: Graph, args, error: Exception):
        """`jax.jit` arguments to compile again with after `error`, or None to raise it."""
        return None

    def wrap(self, fn, graph: Graph):
        return fn

    def to_args(self, args, graph: Graph):
        return args

    def from_outputs(self, outs, graph: Graph):
        return outs


class Local(Strategy):
    name = "local"
    library_products = True


class Replicated(Strategy):
    name = "replicated"
    donates = False
    persistable = False

    def wrap(self, fn, graph: Graph):
        """Each global parameter is every replica's local buffer concatenated on dim 0 (0-d
        values as shape (1,)), so inside the program each replica sees its own values."""
        jax = pjrt.jax_module()
        from jax.sharding import PartitionSpec as P
        mesh = job.replica_mesh(jax)
        world = mesh.devices.size
        in_shapes = [p.avals[0][0] for p in graph.params]
        out_shapes = [n.avals[i][0] for n, i in graph.roots]
        if graph.checks is not None:
            out_shapes.append((3,))  # each replica's own index-check error vector

        def body(*gparams):
            local = [g.reshape(()) if len(s) == 0 else g for g, s in zip(gparams, in_shapes)]
            lowering_ctx.axis, lowering_ctx.world = "r", world
            try:
                outs = fn(*local)
            finally:
                lowering_ctx.axis, lowering_ctx.world = None, 1
            return tuple(o.reshape((1,)) if len(s) == 0 else o for o, s in zip(outs, out_shapes))

        spec = P("r")
        return jax.shard_map(body, mesh=mesh, in_specs=tuple(spec for _ in in_shapes),
                             out_specs=tuple(spec for _ in out_shapes), check_vma=False)

    def to_args(self, args, graph: Graph):
        """Local buffers -> global arrays sharded over the replica mesh."""
        jax = pjrt.jax_module()
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = job.replica_mesh(jax)
        world = mesh.devices.size
        sharding = NamedSharding(mesh, P("r"))
        dev = pjrt.default_device()
        out = []
        for a, p in zip(args, graph.params):
            if len(p.avals[0][0]) == 0:
                a = np.reshape(np.asarray(a), (1,)) if not hasattr(a, "addressable_shards") else a.reshape((1,))
            if not hasattr(a, "addressable_shards"):
                a = jax.device_put(a, dev)
            gshape = (a.shape[0] * world,) + tuple(a.shape[1:])
            out.append(jax.make_array_from_single_device_arrays(gshape, sharding, [a]))
        return out

    def from_outputs(self, outs, graph: Graph):
        res = []
        for o, (n, i) in zip(outs, graph.roots):
            local = o.addressable_shards[0].data
            if len(n.avals[i][0]) == 0:
                local = local.reshape(())
            res.append(local)
        return res


class Spmd(Local):
    persistable = False
    library_products = False
    execute_metric = "ExecuteReplicatedTime"

    @property
    def name(self) -> str:
        # Automatic sharding makes another program of the same graph (inputs laid out by
        # its rule, on its mesh): keyed apart.
        return auto_sharding.key_name() if auto_sharding.enabled() else "spmd"

    def to_args(self, args, graph: Graph):
        # Host data goes to the devices now (once: the leaf keeps the placed array); data
        # placed before SPMD mode (on one device) joins the mesh, replicated, or, under
        # automatic sharding, as its rule lays it out.
        auto = auto_sharding.enabled()
        out = []
        for a, p in zip(args, graph.params):
            if auto and (type(a) is pjrt.HostArray or _on_device(a)):
                a = auto_sharding.place(p, a)
            elif type(a) is pjrt.HostArray:
                a = p.array = a.place()
            elif _on_device(a):
                a = partitioning.on_mesh(a)
            out.append(a)
        return out

    def jit_options(self, graph: Graph, args) -> dict:
        return self._placement(graph, args)

    def compiled(self) -> None:
        if auto_sharding.enabled():
            auto_sharding.count_compile()

    def _placement(self, graph: Graph, args) -> dict:
        """Without device data among the inputs jax would place the program on one device:
        its outputs are then replicated over all devices, or laid out as constrained."""
        if any(_on_device(a) for a in args):
            return {}
        rep = partitioning.replicated_sharding()
        # With a sharding constraint inside, the program is on the mesh: XLA chooses the
        # layout of the other outputs (propagated from the constraints) as with device inputs.
        free = rep
        if any(type(n) is ir.Node and n.op == "xla::sharding_constraint" for n in graph.order):
            free = pjrt.unspecified_sharding() or rep
        outs = []
        for n, _ in graph.roots:
            outs.append(n.args[1] if type(n) is ir.Node and n.op == "xla::sharding_constraint" else free)
        if graph.checks is not None:
            outs.append(rep)
        return {"out_shardings": tuple(outs)}

    def retry_options(self, graph: Graph, args, error: Exception):
        """jax expresses outputs on the mesh of the first named input; when a result's
        layout does not fit that mesh, compile again with mesh-free input shardings."""
        if type(error).__name__ != "IndivisibleError":
            return None
        ins = tuple(partitioning.gspmd(a.sharding, ndim=a.ndim) if _on_device(a) else partitioning.replicated_sharding()
                    for a in args)
        return {"in_shardings": ins, **self._placement(graph, args)}


def _on_device(a) -> bool:
    """Whether a program argument is device data (not a host scalar or host array)."""
    return not isinstance(a, (np.ndarray, np.generic, pjrt.HostArray, int, float, bool))


LOCAL = Local()
REPLICATED = Replicated()
SPMD = Spmd()


def for_graph(graph: Graph):
    """The strategy of a walked graph."""
    if mode.modes.spmd:
        return SPMD
    if graph.has_collective and job.is_multiprocess():
        return REPLICATED
    return LOCAL
