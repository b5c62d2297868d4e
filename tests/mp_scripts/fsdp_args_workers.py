"""Workers of tests/test_fsdp_args.py: FSDP with the collective options (coalesced
all-gathers, bucketed reduce-scatters, shard padding, a barrier at the end of the
backward) trained on each replica's slice of the global batch of tests/mp_scripts/fsdp_workers.py."""
from __future__ import annotations

import faulthandler

import torch
import torch.nn.functional as F

from .fsdp_workers import BATCH, STEPS, batch, net

CONFIGS = {
    "coalesce_bucket": dict(coalesce_all_gather_ops=True, reduce_scatter_bucket_size_mb=1e-4),
    "dim0_bucket_coalesce": dict(shard_param_on_dim_0=True, reduce_scatter_bucket_size_mb=1e-3,
                                 coalesce_all_gather_ops=True, reshard_after_forward=False),
    "multiple_flatten_sync": dict(_shard_size_multiple=128, flatten_parameters=True, sync_on_finalization=True,
                                  reduce_scatter_bucket_size_mb=1),
}


def fsdp_args_job(index: int):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP

    faulthandler.dump_traceback_later(240, exit=True)
    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    out = {"rank": r}
    for name, kw in CONFIGS.items():
        m = net()
        m.conv1, m.fc1 = FSDP(m.conv1, **kw), FSDP(m.fc1, **kw)
        m = FSDP(m, **kw)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
        losses = []
        for step in range(STEPS):
            x, y = batch(step, n)
            x, y = x[BATCH * r:BATCH * (r + 1)].to(dev), y[BATCH * r:BATCH * (r + 1)].to(dev)
            opt.zero_grad()
            if name == "coalesce_bucket" and step == 1:
                # Accumulation: half the slice under no_sync(), then the other half.
                with m.no_sync():
                    first = F.nll_loss(m(x[:BATCH // 2]), y[:BATCH // 2]) / 2
                    first.backward()
                second = F.nll_loss(m(x[BATCH // 2:]), y[BATCH // 2:]) / 2
                second.backward()
                loss = first.detach() + second.detach()
            else:
                loss = F.nll_loss(m(x), y)
                loss.backward()
            m.clip_grad_norm_(0.5)
            opt.step()
            losses.append(xm.all_reduce("sum", loss.detach(), scale=1.0 / n))
            xm.mark_step()
        out[name] = {"losses": [t.cpu() for t in losses],
                     "state_dict": {k: v.cpu() for k, v in m.state_dict().items()},
                     "meta": m.get_shard_metadata(),
                     "shards": [p.numel() for p in m.parameters()]}
    faulthandler.cancel_dump_traceback_later()
    return out
