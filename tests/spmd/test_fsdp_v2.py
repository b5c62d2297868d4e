"""FSDPv2 (FSDP through SPMD) against eager CPU training."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2
from models import ResidualBlock

N = xr.global_runtime_device_count()


def _mesh():
    return xs.Mesh(np.arange(N), (N, 1), ("fsdp", "model"))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(steps, batch=16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def _device_bytes(t):
    arr = torch_xla._engine.tensor.state_of(t).node.array
    return max(s.data.nbytes for s in arr.addressable_shards)


@pytest.mark.parametrize("positional", [True, False])
def test_fsdp_v2_trains_like_cpu(positional):
    ref = _model()
    model = copy.deepcopy(ref).to("xla")
    mesh = _mesh()
    model = FSDPv2(model, mesh) if positional else FSDPv2(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in _data(12):
        ropt.zero_grad()
        rl = nn.functional.cross_entropy(ref(x), y)
        rl.backward()
        ropt.step()
        xx, yy = x.to("xla"), y.to("xla")
        xs.mark_sharding(xx, mesh, ("fsdp", None))
        opt.zero_grad()
        out = model(xx)
        assert torch_xla._XLAC._get_xla_sharding_spec(out) == "{devices=[%d,1]%s}" % (
            N, ",".join(map(str, range(N))))
        loss = nn.functional.cross_entropy(out, yy)
        loss.backward()
        opt.step()
        xm.mark_step()
        np.testing.assert_allclose(float(loss.detach()), float(rl), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-3, atol=1e-4)
    # Each device holds 1/N of every parameter and of its optimizer state.
    for p in model.parameters():
        assert _device_bytes(p) * N == p.numel() * 4
        st = opt.state[p]
        assert _device_bytes(st["exp_avg"]) * N == p.numel() * 4


def test_fsdp_v2_program_gathers_and_scatters():
    model = FSDPv2(_model().to("xla"), _mesh())
    x = torch.randn(16, 16).to("xla")
    xs.mark_sharding(x, _mesh(), ("fsdp", None))
    model(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    from torch_xla._engine import executor
    from torch_xla._engine.tensor import state_of
    roots = [(state_of(g).node, state_of(g).idx) for g in grads]
    hlo = executor.lowered(roots).compile().as_text()
    assert "all-gather" in hlo
    assert "reduce-scatter" in hlo or "all-reduce" in hlo
    xm.mark_step()


def test_fsdp_v2_errors():
    with pytest.raises(ValueError, match="'fsdp'"):
        FSDPv2(_model(), xs.Mesh(np.arange(N), (N,), ("data",)))
    with pytest.raises(RuntimeError, match="forward"):
        FSDPv2(nn.ModuleList([nn.Linear(2, 2)]), _mesh())
    wrapped = FSDPv2(_model(), _mesh())
    with pytest.raises(RuntimeError, match="already wrapped"):
        FSDPv2(wrapped, _mesh())


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), y, reduction="none")


def test_documented_samples_auto_wrap_checkpoint_and_shard_output():
    import functools

    from torch_xla.distributed.fsdp import checkpoint_module
    from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
    torch.manual_seed(0)
    ref = _Net()
    mesh = _mesh()
    g = torch.Generator().manual_seed(2)
    x_cpu, y_cpu = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    ref_loss = ref(x_cpu, y_cpu).sum()
    ref_loss.backward()

    def shard_output(output, mesh):
        xs.mark_sharding(output, mesh, ("fsdp",))

    for build in ("auto_wrap", "checkpoint", "shard_output"):
        my_module = copy.deepcopy(ref).to("xla")
        for p in my_module.parameters():
            p.grad = None
        if build == "auto_wrap":
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={ResidualBlock})
            model = FSDPv2(my_module, mesh=mesh, auto_wrap_policy=policy)
            assert isinstance(model.module.blocks[0], FSDPv2)
        elif build == "checkpoint":
            # Reentrant checkpointing (as the CPU's): a block whose input needs no gradient
            # would give its parameters none, so the blocks after the first are checkpointed.
            for b in my_module.blocks[1:]:
                checkpoint_module(b)
            model = FSDPv2(my_module, mesh)
        else:
            model = FSDPv2(my_module, mesh, shard_output)
        x = xs.mark_sharding(x_cpu.to("xla"), mesh, ("fsdp", None))
        output = model(x, y_cpu.to("xla"))
        loss = output.sum()
        loss.backward()
        xm.mark_step()
        np.testing.assert_allclose(float(loss.detach().cpu() if not hasattr(loss, "global_tensor")
                                         else loss.global_tensor.cpu()), float(ref_loss), rtol=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
