"""Workers of tests/test_fsdp_scale.py: the MNIST CNN and the decoder under FSDP on N replicas.

Replica r trains on slice r of a global batch that depends only on the step. Each config
returns per-step losses (averaged over replicas), the shard sizes it holds on its device,
and its sharded state dict with the metadata needed to consolidate it."""
from __future__ import annotations

import faulthandler
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402  (tests/models.py)

STEPS = 3
BATCH = 2  # per replica
SEQ = 16


def mnist():
    torch.manual_seed(0)
    return models.MNIST()


def decoder():
    torch.manual_seed(0)
    return models.Decoder(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq=SEQ)


def mnist_batch(step: int, world: int):
    (x, y), = models.mnist_data(1, batch=BATCH * world, seed=100 + step)
    return x, y


def lm_batch(step: int, world: int):
    (x, y), = models.lm_data(1, batch=BATCH * world, seq=SEQ, vocab=64, seed=100 + step)
    return x, y


def mnist_loss(model, x, y):
    return torch.nn.functional.nll_loss(model(x), y)


def lm_loss(model, x, y):
    return models.lm_loss(model(x), y)


# name -> (model, batch, loss, how it is wrapped)
CONFIGS = {
    "mnist_nested_zero3": ("mnist", "nested"),
    "decoder_auto_zero3_ckpt": ("decoder", "auto_ckpt"),
    "decoder_zero2": ("decoder", "zero2"),
}
KINDS = {"mnist": (mnist, mnist_batch, mnist_loss), "decoder": (decoder, lm_batch, lm_loss)}


def _device_elements(t) -> int:
    """Elements of the device buffer that holds `t` after the barrier (not its view's shape)."""
    from torch_xla._engine import tensor
    arr = tensor.state_of(t).node.array
    return sum(s.data.size for s in arr.addressable_shards)


def fsdp_scale_job(index: int):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP, checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

    faulthandler.dump_traceback_later(420, exit=True)
    dev = torch_xla.device()
    r, n = xr.global_ordinal(), xr.world_size()
    out = {"rank": r, "world": n}
    for name, (kind, how) in CONFIGS.items():
        make, batch, loss_fn = KINDS[kind]
        m = make()
        if how == "nested":
            m.conv1, m.fc1 = FSDP(m.conv1), FSDP(checkpoint_module(m.fc1))
            m = FSDP(m)
        elif how == "auto_ckpt":
            m = FSDP(m, auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={models.Block}),
                     auto_wrapper_callable=lambda mod, *a, **k: FSDP(checkpoint_module(mod), *a, **k))
        else:
            m = FSDP(m, reshard_after_forward=False)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        losses, hlo = [], ""
        start = met.metric_data("TransferFromDeviceTime") or (0,)
        for step in range(STEPS):
            x, y = batch(step, n)
            x, y = x[BATCH * r:BATCH * (r + 1)].to(dev), y[BATCH * r:BATCH * (r + 1)].to(dev)
            opt.zero_grad()
            loss = loss_fn(m, x, y)
            loss.backward()
            opt.step()
            losses.append(xm.all_reduce("sum", loss.detach(), scale=1.0 / n))
            if step == STEPS - 1:
                hlo = xm.get_stablehlo([loss] + list(m.parameters()))
            xm.mark_step()
        end = met.metric_data("TransferFromDeviceTime") or (0,)
        # What this replica holds: the element count of each parameter's device buffer.
        held = [_device_elements(p) for p in m.parameters()]
        out[name] = {"losses": [t.cpu() for t in losses], "held": held, "reads": end[0] - start[0],
                     "collectives": {op: hlo.count(f'"stablehlo.{op}"') for op in ("all_gather", "reduce_scatter")},
                     "state_dict": {k: v.cpu() for k, v in m.state_dict().items()},
                     "meta": m.get_shard_metadata()}
    faulthandler.cancel_dump_traceback_later()
    return out
