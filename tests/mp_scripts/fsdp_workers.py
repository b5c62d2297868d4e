"""Workers of tests/test_fsdp.py: FSDP, ZeRO-1 and list-form collectives on each replica.

A replica trains on its slice of a global batch that depends only on the step; the test
trains the same model on the whole batch on the CPU and compares."""
from __future__ import annotations

import faulthandler
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 4  # per replica
STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.fc1 = nn.Linear(3 * 6 * 6, 10)
        self.fc2 = nn.Linear(10, 3)
        self.register_buffer("gain", torch.full((3,), 1.5))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc2(torch.tanh(self.fc1(x.flatten(1)))) * self.gain, -1)


def batch(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH * world, 1, 14, 14, generator=g), torch.randint(0, 3, (BATCH * world,), generator=g)


def net():
    torch.manual_seed(0)
    return Net()


CONFIGS = {
    "nested_ckpt_reshard": dict(nested=True, ckpt=True, kw=dict()),
    "flatten": dict(nested=True, ckpt=False, kw=dict(flatten_parameters=True)),
    "dim0_no_reshard": dict(nested=False, ckpt=False, kw=dict(shard_param_on_dim_0=True, reshard_after_forward=False)),
    "auto_wrap": dict(nested=False, ckpt=True, auto=True, kw=dict()),
}


def fsdp_job(index: int, ckpt_dir: str):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    faulthandler.dump_traceback_later(240, exit=True)
    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    out = {"rank": r}
    for name, cfg in CONFIGS.items():
        m = net()
        kw = cfg["kw"]
        if cfg["nested"]:
            wrap = checkpoint_module if cfg["ckpt"] else (lambda z: z)
            m.conv1, m.fc1 = FSDP(wrap(m.conv1), **kw), FSDP(wrap(m.fc1), **kw)
        if cfg.get("auto"):
            kw = dict(kw, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=40),
                      auto_wrapper_callable=lambda mod, *a, **k: FSDP(checkpoint_module(mod), *a, **k))
        m = FSDP(m, **kw)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
        losses, norms = [], []
        for step in range(STEPS):
            x, y = batch(step, n)
            x, y = x[BATCH * r:BATCH * (r + 1)].to(dev), y[BATCH * r:BATCH * (r + 1)].to(dev)
            opt.zero_grad()
            loss = F.nll_loss(m(x), y)
            loss.backward()
            norms.append(m.clip_grad_norm_(0.5))
            opt.step()
            losses.append(xm.all_reduce("sum", loss.detach(), scale=1.0 / n))
            xm.mark_step()
        out[name] = {"losses": [t.cpu() for t in losses], "norms": [t.cpu() for t in norms],
                     "shards": [(nm, p.numel()) for nm, p in m.named_parameters()],
                     "state_dict": {k: v.cpu() for k, v in m.state_dict().items()},
                     "meta": m.get_shard_metadata()}
        if name == "nested_ckpt_reshard":
            xm.save({"model": m.state_dict(), "shard_metadata": m.get_shard_metadata()},
                    f"{ckpt_dir}/ckpt_rank-{r:08d}-of-{n:08d}.pth", master_only=False)
    # Gradient accumulation: the first micro-batch of each step under no_sync().
    m = FSDP(net())
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    for step in range(STEPS):
        x, y = batch(step, n)
        x, y = x[BATCH * r:BATCH * (r + 1)].to(dev), y[BATCH * r:BATCH * (r + 1)].to(dev)
        opt.zero_grad()
        with m.no_sync():
            F.nll_loss(m(x[:BATCH // 2]), y[:BATCH // 2]).backward()
        F.nll_loss(m(x[BATCH // 2:]), y[BATCH // 2:]).backward()
        opt.step()
        xm.mark_step()
    out["no_sync"] = {"state_dict": {k: v.cpu() for k, v in m.state_dict().items()}, "meta": m.get_shard_metadata()}
    # ZeRO-1
    m = net().to(dev)
    opt = ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=0.01, max_norm=0.5)
    for step in range(STEPS):
        x, y = batch(step, n)
        opt.zero_grad()
        F.nll_loss(m(x[BATCH * r:BATCH * (r + 1)].to(dev)), y[BATCH * r:BATCH * (r + 1)].to(dev)).backward()
        opt.step()
        xm.mark_step()
    out["zero1"] = {"params": {k: v.cpu() for k, v in m.state_dict().items()},
                    "shard_numels": [s.numel() for g in opt.base_optimizer.param_groups for s in g["params"]]}
    # List forms of the collectives.
    a = (torch.arange(6.0).reshape(2, 3) + 10 * r).to(dev)
    b = (torch.arange(4.0) * (r + 1)).to(dev)
    gathered = xm.all_gather([a, b], dim=0)
    bucketed = xm.all_gather_bucketized([a, b], dim=0, bucket_cap_mb=1e-5)
    rs = xm.reduce_scatter_bucketized("sum", [a.repeat(n, 1), b.repeat(n)], 1.0, 0, n, bucket_cap_mb=1e-5)
    outs = [torch.zeros(2 * n, 3, device=dev), torch.zeros(4 * n, device=dev)]
    xm.all_gather([a, b], dim=0, output=outs)
    rs_out = [torch.zeros(2 * n, 3, device=dev)]  # takes the shard's shape, as in PyTorch/XLA
    rs_ret = xm.reduce_scatter("sum", [a.repeat(n, 1)], 1.0, 0, n, output=rs_out)
    assert rs_ret is rs_out
    xm.mark_step()
    out["collectives"] = {"gathered": [t.cpu() for t in gathered], "bucketed": [t.cpu() for t in bucketed],
                          "rs": [t.cpu() for t in rs], "out": [t.cpu() for t in outs],
                          "rs_out": [t.cpu() for t in rs_out]}
    faulthandler.cancel_dump_traceback_later()
    return out
