"""Replica functions for tests/test_dist_groups.py (importable, so `spawn` can pickle them)."""
from __future__ import annotations

import torch

from mp_scripts.workers import rank_input


def subgroup_job(index: int):
    """Collectives of `xla` process groups over parts of the world; CPU results."""
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401

    dist.init_process_group("xla", init_method="xla://")
    dev = torch_xla.device()
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    # Every rank creates every group (torch.distributed requires it), in the same order.
    singles = [dist.new_group(ranks=[i]) for i in range(n)]
    mine = singles[r]
    t = rank_input(r).to(dev)
    dist.all_reduce(t, group=mine)
    out["single_all_reduce"] = t.cpu()
    t = rank_input(r).to(dev)
    dist.broadcast(t, src=r, group=mine)
    out["single_broadcast"] = t.cpu()
    if n >= 4:
        pairs = [dist.new_group(ranks=[2 * i, 2 * i + 1]) for i in range(n // 2)]
        strided = [dist.new_group(ranks=list(range(j, n, n // 2))) for j in range(n // 2)]
        for name, groups in (("pair", pairs), ("strided", strided)):
            g = next(pg for pg in groups if r in dist.get_process_group_ranks(pg))
            t = rank_input(r).to(dev)
            dist.all_reduce(t, group=g)
            out[f"{name}_all_reduce"] = t.cpu()
            parts = [torch.zeros(2, 3, device=dev) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, rank_input(r).to(dev), group=g)
            out[f"{name}_all_gather"] = [p.cpu() for p in parts]
            objs = [None] * dist.get_world_size(g)
            dist.all_gather_object(objs, f"r{r}", group=g)
            out[f"{name}_objects"] = objs
    # A receive from any source reports the sender's rank.
    if r == 0:
        got = torch.zeros(2, 3)
        src = dist.recv(got)
        out["recv_any"] = (src, got)
    elif r == 1:
        dist.send(rank_input(r), dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return out
