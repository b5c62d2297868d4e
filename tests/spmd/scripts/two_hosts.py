"""One host of a simulated 2-host SPMD job (2 CPU devices each): HybridMesh over the
hosts, an MLP trained data-parallel across hosts and sharded within each; prints losses."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from models import mlp, mlp_batches, train_classifier  # noqa: E402

xr.use_spmd()
assert xr.global_runtime_device_count() == 4 and xr.addressable_runtime_device_count() == 2
mesh = xs.HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("data", "model"))
model = mlp(32).to("xla")
xs.mark_sharding(model[0].weight, mesh, ("model", None))


def shard(x, y):
    x, y = x.to("xla"), y.to("xla")
    xs.mark_sharding(x, mesh, ("data", None))
    xs.mark_sharding(y, mesh, ("data",))
    return x, y


losses = train_classifier(model, mlp_batches(int(sys.argv[1])), shard, xm.mark_step)
w = model[0].weight.detach().cpu()
print("RESULT " + json.dumps({"rank": xr.process_index(), "losses": losses, "w_sum": float(w.sum())}), flush=True)
