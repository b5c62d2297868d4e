"""Run under torchrun: xmp.spawn starts no process; `xla://` finds rank and world size."""

import torch
import torch.distributed as dist

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_backend  # noqa: F401
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr


def _mp_fn(index):
    dist.init_process_group("xla", init_method="xla://")
    r, n = dist.get_rank(), dist.get_world_size()
    assert r == xr.global_ordinal() and n == xr.world_size(), (r, n, xr.global_ordinal(), xr.world_size())
    t = torch.tensor([float(r + 1)]).to(torch_xla.device())
    dist.all_reduce(t)
    s = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(r + 1)]).to(torch_xla.device()))
    torch_xla.sync()
    assert float(s.cpu()[0]) == float(t.cpu()[0])
    objs = [None] * n
    dist.all_gather_object(objs, r)
    assert objs == list(range(n)), objs
    # a CPU job names a replica's device by its global ordinal (PyTorch/XLA's numbering)
    print(f"RESULT rank={r} world={n} sum={float(t.cpu()[0])} spawn_index={index} device={t.device}",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=())
