"""The `xla` process group of torch.distributed: `ProcessGroupXla` and its collectives.

Collectives on XLA tensors are the lazy collectives of `xm` (all_reduce, all_gather,
...): they become part of the step's graph and every replica must issue them in the same
order. Collectives on CPU tensors (used by `all_gather_object`, `broadcast_object_list`,
...) and send/recv go through the coordination service's key-value store. Every returned
Work is already complete.

A group's XLA collectives run over `groups=` replica groups: every replica issues the
collective within its own group of an even partition of the world (`group_mesh`).
"""
from __future__ import annotations

import io
import itertools
import time
from typing import List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work
from torch.distributed import ProcessGroup

import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from .._engine import comm as _coll
from .._engine import job as _job
from .._engine import tensor as _tensor
from ._xla_store import service_error, status_code, store_error

__all__ = ["ProcessGroupXla", "UnsupportedCallForm", "WorkXla", "group_mesh"]


# ---- Work -------------------------------------------------------------------------------

class WorkXla(Work):
    """A finished piece of work: the collective is a lazy op already in the step graph."""

    def __init__(self, result: Optional[List[torch.Tensor]] = None, source_rank: int = -1):
        super().__init__()
        self._result = result if result is not None else []
        self._source = source_rank
        self._future = torch.futures.Future()
        self._future.set_result(self._result)

    def wait(self, timeout=None):  # noqa: ARG002 (c10d's Work signature; the work is complete)
        return True

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self):
        return self._future

    def synchronize(self):
        return None

    def _source_rank(self):
        """The group rank a receive from any source got its data from."""
        return self._source

    def source_rank(self):
        return self._source



# ---- the process group ------------------------------------------------------------------

_REDUCE_OPS = {
    dist.ReduceOp.SUM: xm.REDUCE_SUM,
    dist.ReduceOp.PRODUCT: xm.REDUCE_MUL,
    dist.ReduceOp.MIN: xm.REDUCE_MIN,
    dist.ReduceOp.MAX: xm.REDUCE_MAX,
    dist.ReduceOp.BAND: xm.REDUCE_AND,
    dist.ReduceOp.BOR: xm.REDUCE_OR,
}


def _reduce_kind(op):
    """(xm reduce type, scale) of a torch ReduceOp."""
    if op == dist.ReduceOp.AVG:
        return xm.REDUCE_SUM, None
    for k, v in _REDUCE_OPS.items():
        if op == k:
            return v, 1.0
    raise NotImplementedError(f"the xla process group does not support reduce op {op}")


class UnsupportedCallForm(TypeError, NotImplementedError):
    """A call form the group does not take (e.g. a bare tensor where c10d passes a list).

    A TypeError, as PyTorch's process groups raise for wrong arguments; also a
    NotImplementedError, which torch_xla's own group raised for every call of
    allreduce_coalesced and recv_anysource, so code written against it still catches it."""


def _is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def _fv(t: torch.Tensor) -> torch.Tensor:
    """A functional view of an XLA tensor to compute with (inner tensors get a wrapper)."""
    if _is_xla(t) and not torch._is_functional_tensor(t):
        return torch._to_functional_tensor(t)
    return t


def _np_reduce(kind, arrays):
    import numpy as np
    a = np.stack(arrays)
    if kind == xm.REDUCE_SUM:
        return a.sum(0)
    if kind == xm.REDUCE_MUL:
        return a.prod(0)
    if kind == xm.REDUCE_MIN:
        return a.min(0)
    if kind == xm.REDUCE_MAX:
        return a.max(0)
    if kind == xm.REDUCE_AND:
        return np.logical_and.reduce(a, 0) if a.dtype == bool else np.bitwise_and.reduce(a, 0)
    if kind == xm.REDUCE_OR:
        return np.logical_or.reduce(a, 0) if a.dtype == bool else np.bitwise_or.reduce(a, 0)
    raise NotImplementedError(kind)


def _dumps(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().cpu().contiguous(), buf)
    return buf.getvalue()


def _loads(b: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(b), weights_only=True)


class ProcessGroupXla(ProcessGroup):
    """torch.distributed process group with XLA collectives.

    `_mesh` is the partition of the world into groups that the group's XLA collectives
    run over (the `groups=` of the xm collectives): every replica issues the collective,
    each within its own group of the partition. `[]` means all replicas; `None` (a
    subgroup that does not partition the world evenly) leaves XLA collectives
    unavailable, since every replica of one program must issue the same collective.
    """

    def __init__(self, prefix_store, rank: int, size: int, timeout=None):
        super().__init__(rank, size)
        self._store = prefix_store
        self._timeout = timeout
        self._rank = rank
        self._size = size
        self._mesh = []
        self._p2p_seq = {}
        self._host_seq = itertools.count()

    # -- identity -------------------------------------------------------------------------
    def getBackendName(self):
        return "xla"

    def name(self):
        return "xla"

    # torch.distributed names every group (`_set_group_name`) and the functional collectives
    # (torch.distributed._functional_collectives, Dynamo's traced collectives) find a group by
    # that name. ProcessGroup keeps the name on its registered backends; this group is its own
    # backend and has none registered, so it keeps the name itself.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    # -- helpers --------------------------------------------------------------------------
    def _members(self) -> List[int]:
        """The global ranks of this group, in group-rank order."""
        try:
            return list(dist.get_process_group_ranks(self))
        except (RuntimeError, ValueError, KeyError):  # not registered with torch.distributed
            return list(range(self._size))

    def _groups(self):
        """The `groups=` of this group's XLA collectives (None: all replicas)."""
        if self._mesh is None:
            raise ValueError(
                f"process group over ranks {self._members()} does not split the world evenly, so its "
                "collectives on XLA tensors cannot be issued by every replica; create it with ranks "
                "that tile the world (e.g. pg_options={'xla_pg_options': {'spmd': True}}) or pass a "
                "mesh (pg_options={'xla_pg_options': {'mesh': [[...], ...]}})")
        if not self._mesh or len(self._mesh) == 1:
            return None
        return self._mesh

    def _host_gather(self, t: torch.Tensor, what: str) -> List[torch.Tensor]:
        """Every member's copy of a host tensor, through the key-value store."""
        members = self._members()
        tag = f"torch_xla/pg/{what}"
        if len(members) != xr.world_size():  # a subgroup: its own tags, its members only
            tag += "/" + ",".join(map(str, members))
        payloads = _coll.rendezvous(tag, _dumps(t), replicas=members)
        return [_loads(p) for p in payloads]

    @staticmethod
    def _assign(dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src, in place. torch.distributed hands a backend the *inner* XLA tensors
        (functionalization unwraps the arguments of c10d ops), so an XLA destination that is
        not a functional wrapper gets the new value by pointing it at src's IR value."""
        with torch.no_grad():
            if _is_xla(dst) and not torch._is_functional_tensor(dst):
                src = _fv(src.to(dst.device)).to(dst.dtype).reshape(dst.shape)
                _tensor.replace_state(dst, _tensor.state_of(src))
            else:
                dst.copy_(src.to(dst.dtype).reshape(dst.shape))

    # c10d hands each collective its options. Those of all_gather, all_to_all and barrier
    # hold only a timeout (and barrier's device ids): a collective on XLA tensors is part
    # of the step's program, and host exchanges wait XLA_COLLECTIVE_TIMEOUT_S, so these
    # methods take their options and leave them.

    # -- all_reduce -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None and hasattr(opts, "reduceOp") else dist.ReduceOp.SUM
        kind, scale = _reduce_kind(op)
        if scale is None:
            scale = 1.0 / self._size
        results = []
        for t in tensors:
            k = xm.REDUCE_OR if (kind == xm.REDUCE_SUM and t.dtype == torch.bool) else kind
            if _is_xla(t):
                r = xm.all_reduce(k, _fv(t), scale=scale, groups=self._groups())
                self._assign(t, r)
                results.append(r)
            else:
                parts = self._host_gather(t, "allreduce")
                r = torch.from_numpy(_np_reduce(k, [p.numpy() for p in parts]))
                if scale != 1.0:
                    r = r * scale
                self._assign(t, r)
                results.append(t)
        # The future's value: functional tensors holding the results (DDP takes views of them).
        return WorkXla(results)

    def allreduce_coalesced(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            raise UnsupportedCallForm(
                f"allreduce_coalesced(): expected a list of tensors, got {type(tensors).__name__}")
        return self.allreduce(tensors, opts)

    # -- all_gather -----------------------------------------------------------------------
    def allgather(self, output_tensors_lists, input_tensors, opts=None):  # noqa: ARG002 (c10d's signature, see above)
        for outs, inp in zip(output_tensors_lists, input_tensors):
            if _is_xla(inp):
                g = xm.all_gather(_fv(inp).reshape(1, -1), dim=0, groups=self._groups())  # (n, numel)
                for o, part in zip(outs, g):
                    self._assign(o, part)
            else:
                parts = self._host_gather(inp, "allgather")
                for o, p in zip(outs, parts):
                    self._assign(o, p)
        return WorkXla([t for outs in output_tensors_lists for t in outs])

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """One collective gathers every XLA input (flattened, along dim 0)."""
        if input_list and all(_is_xla(t) for t in input_list):
            flat = [_fv(t).reshape(-1) for t in input_list]
            gathered = xm.all_gather(flat, dim=0, groups=self._groups())
            for outs, inp, g in zip(output_lists, input_list, gathered):
                for o, part in zip(outs, g.reshape(-1, max(inp.numel(), 1))):
                    self._assign(o, part)
            return WorkXla([t for outs in output_lists for t in outs])
        return self.allgather(output_lists, input_list, opts)

    def _allgather_base(self, output, input, opts=None):  # noqa: ARG002 (c10d's signature, see above)
        if _is_xla(input):
            self._assign(output, xm.all_gather(_fv(input).reshape((1,) + tuple(input.shape)), dim=0,
                                               groups=self._groups()))
        else:
            parts = self._host_gather(input, "allgather_base")
            self._assign(output, torch.cat([p.reshape(1, -1) for p in parts]))
        return WorkXla([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._allgather_base(o, i, opts)
        return WorkXla(list(outputs))

    # -- reduce_scatter -------------------------------------------------------------------
    def _reduce_scatter_one(self, output, stacked, op):
        """stacked: (world, *output.shape) on the device."""
        kind, scale = _reduce_kind(op)
        if scale is None:
            scale = 1.0 / self._size
        if _is_xla(stacked):
            r = xm.reduce_scatter(kind, _fv(stacked), scale, 0, self._size, groups=self._groups())
            self._assign(output, r[0])
        else:
            parts = self._host_gather(stacked, "reduce_scatter")
            r = torch.from_numpy(_np_reduce(kind, [p.numpy() for p in parts]))[self._rank]
            if scale != 1.0:
                r = r * scale
            self._assign(output, r)

    def reduce_scatter(self, output_tensors, input_tensors_lists, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, ins in zip(output_tensors, input_tensors_lists):
            self._reduce_scatter_one(out, torch.stack([_fv(i).reshape(out.shape) for i in ins]), op)
        return WorkXla(list(output_tensors))

    def reduce_scatter_coalesced(self, output_tensors, input_tensors_lists, opts=None):
        """torch_xla's name for reduce_scatter over several outputs (one list of world-size
        inputs per output)."""
        return self.reduce_scatter(output_tensors, input_tensors_lists, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        self._reduce_scatter_one(output, _fv(input).reshape((self._size,) + tuple(output.shape)), op)
        return WorkXla([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_base(o, i, opts)
        return WorkXla(list(outputs))

    # -- broadcast / reduce / gather / scatter ----------------------------------------------
    def _from_root(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """The root's value of `t` on every replica: all_reduce(where(rank == root, t, 0)).

        Every replica builds the same graph (the choice is a device value, not Python
        control flow): replicas of one SPMD program must trace identical graphs.
        """
        is_root = torch.tensor(self.rank() == root).to(t.device)
        contrib = torch.where(is_root, t, torch.zeros_like(t))
        kind = xm.REDUCE_OR if t.dtype == torch.bool else xm.REDUCE_SUM
        return xm.all_reduce(kind, contrib, groups=self._groups())

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if _is_xla(t):
                self._assign(t, self._from_root(_fv(t), root))
            else:
                parts = self._host_gather(t, "broadcast")
                self._assign(t, parts[root])
        return WorkXla(list(tensors))

    def reduce(self, tensors, opts=None):
        from torch.distributed import AllreduceOptions
        ar = AllreduceOptions()
        ar.reduceOp = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self.allreduce(tensors, ar)

    def gather(self, output_tensors_lists, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        for outs, inp in zip(output_tensors_lists, input_tensors):
            if _is_xla(inp):
                g = xm.all_gather(_fv(inp).reshape(1, -1), dim=0, groups=self._groups())
                parts = list(g)
            else:
                parts = self._host_gather(inp, "gather")
            if self._rank == root:
                for o, p in zip(outs, parts):
                    self._assign(o, p)
        return WorkXla([t for outs in output_tensors_lists for t in outs])

    def scatter(self, output_tensors, input_tensors_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        for i, out in enumerate(output_tensors):
            if _is_xla(out):
                if self._rank == root:
                    stacked = torch.stack([_fv(t).reshape(out.shape) for t in input_tensors_lists[i]])
                else:  # same graph on every replica: a device buffer of the same shape
                    stacked = torch.zeros((self._size,) + tuple(out.shape), dtype=out.dtype).to(out.device)
                full = self._from_root(stacked, root)
                self._assign(out, full[self._rank])
            else:
                mine = torch.stack(input_tensors_lists[i]) if self._rank == root else torch.zeros(0)
                parts = self._host_gather(mine, "scatter")
                self._assign(out, parts[root][self._rank])
        return WorkXla(list(output_tensors))

    # -- all_to_all -----------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=None):  # noqa: ARG002 (c10d's signature, see above)
        n = self._size
        for splits in (output_split_sizes, input_split_sizes):
            if splits and any(s != splits[0] for s in splits):
                raise NotImplementedError("the xla process group supports all_to_all_single with equal "
                                          f"splits only, got {list(splits)}")
        if _is_xla(input):
            self._assign(output, xm.all_to_all(_fv(input), 0, 0, n, groups=self._groups()))
        else:
            parts = self._host_gather(input, "alltoall")
            self._assign(output, torch.cat([p.chunk(n)[self._rank] for p in parts]))
        return WorkXla([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):  # noqa: ARG002 (c10d's signature, see above)
        n = self._size
        if all(_is_xla(t) for t in input_tensors):
            shapes = {tuple(t.shape) for t in input_tensors}
            if len(shapes) != 1:
                raise NotImplementedError("the xla process group supports all_to_all with equal shapes only")
            stacked = torch.stack([_fv(t) for t in input_tensors])  # (n, ...)
            r = xm.all_to_all(stacked, 0, 0, n, groups=self._groups())
            for i, o in enumerate(output_tensors):
                self._assign(o, r[i])
        else:
            parts = self._host_gather(torch.stack([t.cpu() for t in input_tensors]), "alltoall")
            for i, o in enumerate(output_tensors):
                self._assign(o, parts[i][self._rank])
        return WorkXla(list(output_tensors))

    # The names torch.distributed (>= 2.10) calls for the single-tensor collectives.
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    # -- barrier / point to point --------------------------------------------------------
    def barrier(self, opts=None):  # noqa: ARG002 (c10d's signature, see above)
        if self._size > 1:
            self._host_gather(torch.zeros(0), "barrier")
        return WorkXla([])

    def _next_seq(self, a: int, b: int) -> int:
        k = (a, b)
        s = self._p2p_seq.get(k, 0)
        self._p2p_seq[k] = s + 1
        return s

    def send(self, tensors, dst, tag=0):
        # Keys name global ranks: messages of different groups between the same pair of
        # processes keep one sequence per (sender, receiver, tag).
        client = _job.kv_client()
        members = self._members()
        me, to = members[self._rank], members[dst]
        for t in tensors:
            key = f"torch_xla/pg/p2p/{me}->{to}/{tag}/{self._p2p_seq.get((me, to), 0)}"
            try:
                client.key_value_set_bytes(key, _dumps(t))
            except service_error() as e:
                raise store_error(f"send to rank {to}", e) from e
            self._next_seq(me, to)
        return WorkXla(list(tensors))

    @staticmethod
    def _take(client, key: str, src: int) -> None:
        """Deletes a received message; the caller advances the sequence only afterwards, so
        a failure leaves the message where a later receive finds it again."""
        try:
            client.key_value_delete(key)
        except service_error() as e:
            raise store_error(f"recv from rank {src}", e) from e

    def recv_anysource(self, tensors, tag=0):
        """Receives from whichever member sent first (polling every member's next message)."""
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
            raise UnsupportedCallForm("recv_anysource(): expected a list of one tensor")
        client = _job.kv_client()
        members = self._members()
        me = members[self._rank]
        deadline = time.monotonic() + _job.collective_timeout_s()
        pause = 0.001
        while True:
            for grank, src in enumerate(members):
                if src == me:
                    continue
                key = f"torch_xla/pg/p2p/{src}->{me}/{tag}/{self._p2p_seq.get((src, me), 0)}"
                try:
                    data = client.key_value_try_get_bytes(key)
                except service_error() as e:
                    if status_code(e) != "NOT_FOUND":  # NOT_FOUND: not sent yet
                        raise store_error(f"recv from rank {src}", e) from e
                    continue
                self._take(client, key, src)
                self._next_seq(src, me)
                self._assign(tensors[0], _loads(data).to(tensors[0].device))
                return WorkXla(list(tensors), source_rank=grank)
            if time.monotonic() > deadline:
                raise RuntimeError(f"recv from any source: nothing arrived within {_job.collective_timeout_s()} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def monitored_barrier(self, *args, **kwargs):
        # torch.distributed.monitored_barrier runs on gloo groups only.
        raise NotImplementedError("monitored_barrier is implemented by the gloo backend only; use barrier()")

    def recv(self, tensors, src, tag=0):
        client = _job.kv_client()
        ms = _job.collective_timeout_s() * 1000
        members = self._members()
        me, src = members[self._rank], members[src]
        for t in tensors:
            key = f"torch_xla/pg/p2p/{src}->{me}/{tag}/{self._p2p_seq.get((src, me), 0)}"
            try:
                data = client.blocking_key_value_get_bytes(key, ms)
            except service_error() as e:
                raise store_error(f"recv from rank {src}", e, ms) from e
            self._take(client, key, src)
            self._next_seq(src, me)
            self._assign(t, _loads(data).to(t.device))
        return WorkXla(list(tensors))


# ---- the partition a group's XLA collectives run over -----------------------------------

def _tiling(ranks: List[int], world: int) -> List[List[int]]:
    """The even partition of range(world) that has `ranks` (sorted, 1 < len < world) as
    a group: consecutive blocks or a strided set. ValueError when there is none."""
    k = len(ranks)
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        if step == 1 and world % k == 0 and ranks[0] % k == 0:
            return [list(range(i, i + k)) for i in range(0, world, k)]
        if step * k == world and ranks[0] < step:
            return [list(range(j, world, step)) for j in range(step)]
    raise ValueError(f"ranks {ranks} are not one group of an even partition of the {world} ranks "
                     "(consecutive blocks or a strided set)")


def _check_mesh(mesh, ranks: List[int], world: int) -> List[List[int]]:
    mesh = [[int(r) for r in g] for g in mesh]
    flat = sorted(r for g in mesh for r in g)
    if flat != list(range(world)) or len({len(g) for g in mesh}) != 1:
        raise ValueError(f"mesh {mesh} is not a partition of the {world} ranks into groups of one size")
    if ranks not in mesh:
        raise ValueError(f"mesh {mesh} has no group {ranks}")
    return mesh


def group_mesh(ranks: List[int], world: int, options) -> Optional[List[List[int]]]:
    """The partition a new group's XLA collectives run over (see ProcessGroupXla)."""
    if ranks == list(range(world)):
        return [ranks]
    if len(ranks) == 1:
        return [[r] for r in range(world)]
    opts = options.get("xla_pg_options", {}) if isinstance(options, dict) else {}
    if opts.get("mesh") is not None:
        return _check_mesh(opts["mesh"], ranks, world)
    if opts.get("spmd"):
        return _tiling(ranks, world)
    try:
        return _tiling(ranks, world)
    except ValueError:
        return None  # usable for host data and point to point; XLA collectives refuse
