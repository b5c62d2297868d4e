"""8 CPU devices in one process: the API reference's (4, 2) mesh sample, an MLP on a
(2, 4) data x model mesh and the decoder under FSDPv2; prints losses as JSON."""
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from torch_xla.distributed.spmd import Mesh  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2  # noqa: E402
from models import Decoder, lm_data, lm_loss, mlp, mlp_batches, train_classifier  # noqa: E402
from torch_xla._engine.tensor import state_of  # noqa: E402

xr.use_spmd()
steps = int(sys.argv[1])
out = {}
# The API reference's sample, as written.
mesh_shape = (4, 2)
num_devices = xr.global_runtime_device_count()
device_ids = np.array(range(num_devices))
mesh = Mesh(device_ids, mesh_shape, ("x", "y"))
input = torch.randn(8, 32).to(xm.xla_device())
xs.mark_sharding(input, mesh, (0, None))
linear = nn.Linear(32, 10).to(xm.xla_device())
xs.mark_sharding(linear.weight, mesh, (None, 1))
out["sample"] = float(linear(input).sum())

# MLP, data x model (2, 4).
m = Mesh(device_ids, (2, 4), ("data", "model"))
model = mlp(32, 32).to("xla")
xs.mark_sharding(model[0].weight, m, ("model", None))
xs.mark_sharding(model[2].weight, m, (None, "model"))


def shard(x, y):
    x = x.to("xla")
    xs.mark_sharding(x, m, ("data", None))
    return x, y.to("xla")


out["mlp"] = train_classifier(model, mlp_batches(steps), shard, xm.mark_step)

# Decoder under FSDPv2 over all 8 devices; 10 extra steps must not compile.
torch.manual_seed(0)
dec = FSDPv2(Decoder(n_layers=1).to("xla"), Mesh(device_ids, (8, 1), ("fsdp", "model")),
             shard_output=lambda o, mesh: None)
dopt = torch.optim.AdamW(dec.parameters(), lr=1e-3)
dl = []
compiles = 0
data = lm_data(steps + 10)
for i, (idx, tgt) in enumerate(data):
    if i == steps:
        compiles = met.counter_value("UncachedCompile")
    dopt.zero_grad()
    loss = lm_loss(dec(idx.to("xla")), tgt.to("xla"))
    loss.backward()
    dopt.step()
    xm.mark_step()
    if i < steps:
        dl.append(float(loss.detach()))
    if i == 2:
        p = dec.module.tok.weight
        out["tok_pieces"] = [list(sh.data.shape) for sh in state_of(p).node.array.addressable_shards]
out["decoder"] = dl
out["new_compiles_after_warmup"] = met.counter_value("UncachedCompile") - compiles
print("RESULT " + json.dumps(out), flush=True)
