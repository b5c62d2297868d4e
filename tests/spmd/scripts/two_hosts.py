"""One host of a simulated 2-host SPMD job (2 CPU devices each): HybridMesh over the
hosts, an MLP trained data-parallel across hosts and sharded within each; prints losses."""
import json
import sys

import torch
import torch.nn as nn

import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
assert xr.global_runtime_device_count() == 4 and xr.addressable_runtime_device_count() == 2
mesh = xs.HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("data", "model"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("xla")
xs.mark_sharding(model[0].weight, mesh, ("model", None))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(int(sys.argv[1])):
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    x, y = x.to("xla"), y.to("xla")
    xs.mark_sharding(x, mesh, ("data", None))
    xs.mark_sharding(y, mesh, ("data",))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    xm.mark_step()
    losses.append(float(loss.detach()))
w = model[0].weight.detach().cpu()
print("RESULT " + json.dumps({"rank": xr.process_index(), "losses": losses, "w_sum": float(w.sum())}), flush=True)
