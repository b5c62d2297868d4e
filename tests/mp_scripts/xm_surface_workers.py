"""Replica functions of tests/test_xm_surface.py: xm.send / recv, all_reduce_bucketized_gradients
and do_on_ordinals on each replica. Inputs depend only on the rank; the test computes the
expected values on the CPU."""
from __future__ import annotations

import faulthandler
import os

import torch


def grads_of(rank: int):
    """Gradients of mixed sizes and dtypes (float32, then bfloat16, then float32)."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g),
            torch.randn(6, generator=g).to(torch.bfloat16), torch.randn(3, generator=g)]


def xm_surface_job(index: int, marker_dir: str):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    faulthandler.dump_traceback_later(240, exit=True)
    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    out = {"rank": r}
    # send / recv: 0 -> 1 on channel 5 (twice: the k-th send is the k-th recv), 1 -> 0 on 6.
    mine = (torch.arange(6.0).reshape(2, 3) * (r + 1)).to(dev) + 1  # pending when sent
    if r == 0:
        out["send_ret"] = xm.send(mine, 5).cpu()
        xm.send(mine * 10, 5)
        out["recv"] = [xm.recv(torch.zeros(4, dtype=torch.int64, device=dev), 6).cpu()]
    else:
        out["recv"] = [xm.recv(torch.zeros(2, 3, device=dev), 5).cpu(),
                       xm.recv(torch.zeros(2, 3, device=dev), 5).cpu()]
        xm.send(torch.tensor([r, 7, 8, 9]).to(dev), 6)
    # all_reduce_bucketized_gradients: 0 (one gradient a bucket), 1e-4 MiB (104 bytes), 1 MiB.
    for cap in (0, 1e-4, 1):
        gs = [g.to(dev) for g in grads_of(r)]
        xm.all_reduce_bucketized_gradients(gs, scale=1.0 / n, groups=None, pin_layout=True, bucket_cap_mb=cap)
        xm.mark_step()
        out[f"bucketized_{cap}"] = [g.cpu() for g in gs]
    # do_on_ordinals: data whose pending value holds a collective; only ordinal 1 runs.
    data = (xm.all_reduce("sum", mine), torch.tensor([r]))
    ran = []

    def target(total, rank_t):
        ran.append(True)
        with open(f"{marker_dir}/ran_on_{r}", "w") as f:
            f.write("x")
        return (total.device.type, total.clone(), int(rank_t))

    out["do_on_ordinals"] = xm.do_on_ordinals(target, data, ordinals=(1,))
    out["ran"] = bool(ran)
    # Every replica waits for the others: ordinal 1's target has finished here.
    out["marker_after"] = os.path.exists(f"{marker_dir}/ran_on_1")
    out["int_ordinal"] = xm.do_on_ordinals(lambda: r, (), ordinals=0)
    faulthandler.cancel_dump_traceback_later()
    return out
