"""The `xla` backend of torch.distributed and the `xla://` init method.

    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # registers both
    dist.init_process_group('xla', init_method='xla://')

`xla://` takes rank and world size from the runtime (torch_xla.runtime) and gives
torch.distributed a store built on the job's coordination service (`_xla_store.py`), so
no extra port is needed. The process group and its collectives are in
`_xla_process_group.py`.

`dist.new_group(ranks)` gives a group whose XLA collectives run over `groups=` replica
groups: every replica issues the collective within its own group of an even partition of
the world (consecutive blocks or strided sets, found from `ranks`; or given with
`pg_options={'xla_pg_options': {'mesh': [[...], ...]}}`). A group whose ranks tile nothing
serves host data and send/recv only.

What this module changes in torch.distributed is done by `install()` (patch registry entry
`xla_process_group`, installed at import); `torch.distributed.new_group` itself is PyTorch's.
"""
from __future__ import annotations

import sys
import warnings
from typing import List
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

import torch_xla.runtime as xr
from .._engine import job as _job
from .._engine import patches as _patches
from .._engine import mode as _mode
from .._engine import pjrt as _runtime
from ._xla_process_group import ProcessGroupXla, WorkXla, group_mesh
from ._xla_store import XlaKVStore

__all__ = ["ProcessGroupXla", "XlaKVStore", "WorkXla", "make_xla_process_group", "install"]


def _check_job(rank: int, size: int) -> None:
    rt_size, rt_rank = xr.world_size(), xr.global_ordinal()
    if size != rt_size:
        raise ValueError(f"init_process_group('xla'): world_size={size} but the XLA runtime has "
                         f"{rt_size} replica(s) (TORCH_XLA_JAX_WORLD_SIZE / WORLD_SIZE)")
    if rank != rt_rank:
        raise ValueError(f"init_process_group('xla'): rank={rank} but this process is replica "
                         f"{rt_rank} of the XLA runtime")


def _start_runtime() -> None:
    """Joins the job (jax.distributed) and creates the collective communicators."""
    _job.check_environment()
    _job.check_coordinator_port()
    _runtime.jax_module()  # joins the job and warms up the communicators


def make_xla_process_group(prefix_store, rank, size, timeout) -> ProcessGroupXla:
    """A process group of the `xla` backend over `prefix_store` (the default group's form)."""
    _refuse_in_spmd()
    if not dist.is_initialized():  # the default group: it is the runtime's world
        _check_job(rank, size)
    if xr.world_size() > 1:
        _start_runtime()
    return ProcessGroupXla(prefix_store, rank, size, timeout)


def _create_process_group(*args, **kwargs) -> ProcessGroupXla:
    """The creator registered for the `xla` backend. torch.distributed calls it in its
    extended form, `(opts, pg_options)`: `opts` carries the group's global ranks,
    `pg_options` is what `new_group` was given. A subgroup records the partition of the
    world its XLA collectives use: `pg_options={'xla_pg_options': {'spmd': True}}` asks for
    an even partition (ValueError otherwise); `{'xla_pg_options': {'mesh': [[...], ...]}}`
    gives it. Called as PyTorch/XLA's own creator, `(prefix_store, rank, size, timeout)`
    (`Backend._plugins['XLA'].creator_fn`), it makes that group."""
    if "prefix_store" in kwargs or len(args) + len(kwargs) == 4:
        return make_xla_process_group(*args, **kwargs)
    opts = args[0] if args else kwargs["opts"]
    pg_options = args[1] if len(args) > 1 else kwargs.get("pg_options")
    pg = make_xla_process_group(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    ranks = sorted(int(r) for r in opts.global_ranks_in_group)
    if ranks and dist.is_initialized():   # a subgroup (the default group's list is empty)
        pg._mesh = group_mesh(ranks, dist.get_world_size(), pg_options)
    return pg


class SpmdProcessGroupError(RuntimeError, AssertionError):
    """The `xla` process group belongs to the multi-process replication API, not SPMD."""


def _refuse_in_spmd() -> None:
    if _mode.modes.spmd:
        raise SpmdProcessGroupError(
            "the 'xla' process group is for one process per device (torch_xla.launch / xmp.spawn); in SPMD "
            "mode (xr.use_spmd()) one program spans every device: annotate tensors with mark_sharding instead")


# torch.distributed keeps only the C++ side of the store it is given (inside a PrefixStore):
# without a Python reference the XlaKVStore would be collected once init_process_group
# returns, and every later store call would fail with "Not implemented".
_stores_handed_out: List[XlaKVStore] = []


def _xla_rendezvous_handler(url: str, timeout=None, **kwargs):  # noqa: ARG001 (c10d's rendezvous handler signature)
    """`xla://`: rank and world size from the runtime, store on the coordination service."""
    _refuse_in_spmd()
    _job.check_environment()
    rank, size = xr.global_ordinal(), xr.world_size()
    query = parse_qs(urlparse(url).query)
    if "rank" in query and int(query["rank"][0]) != rank:
        raise ValueError(f"xla:// init: rank={query['rank'][0]} was given but this process is replica {rank}")
    if "world_size" in query and int(query["world_size"][0]) != size:
        raise ValueError(f"xla:// init: world_size={query['world_size'][0]} was given but the job has "
                         f"{size} replica(s)")
    if size > 1 and _job.coordinator_address() is None:
        raise RuntimeError(
            "xla:// init: this process is rank {} of {} but there is no coordinator: start the job with "
            "torch_xla.launch / xmp.spawn or torchrun, or set TORCH_XLA_JAX_COORDINATOR".format(rank, size))
    if size > 1:
        _start_runtime()
        store = XlaKVStore(timeout)
        _stores_handed_out.append(store)
    else:
        store = dist.HashStore()
    yield (store, rank, size)
    raise RuntimeError("xla:// rendezvous handler called again: the store was already handed out")


def install() -> None:
    """Patch `xla_process_group`: registers backend `xla` and the `xla://` rendezvous with
    torch.distributed."""
    dist.Backend.register_backend("xla", _create_process_group, extended_api=True, devices=["xla"])
    try:
        dist.register_rendezvous_handler("xla", _xla_rendezvous_handler)
    except RuntimeError as e:
        # torch refuses a scheme it has. Ours from an earlier install() (or an earlier
        # import of this module) is the same handler; another package's is reported.
        handlers = getattr(sys.modules["torch.distributed.rendezvous"], "_rendezvous_handlers", {})
        other = handlers.get("xla")
        if getattr(other, "__module__", __name__) != __name__:
            warnings.warn(f"torch_xla: xla:// is registered by {other.__module__}.{other.__qualname__}, "
                          f"which is left in place ({e})")


_patches.install("xla_process_group")
