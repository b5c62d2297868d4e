"""PyTorch's DTensor API on the xla device (SPMD), against eager CPU: a tensor-parallel
MLP trained with `distribute_tensor` layouts, Partial placements and their reductions,
`from_local` on a manual region, the DTensorSpec view and its invalidation,
`distribute_module` with `auto_policy`."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import (DeviceMesh, Partial, Replicate, Shard, distribute_module, distribute_tensor,
                                      init_device_mesh)
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla._engine import auto_sharding
from torch_xla.distributed.spmd import XLAShardedTensor
from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor

N = xr.global_runtime_device_count()


def spec(t) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _data(steps=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(steps)]


def _train_cpu(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tensor_parallel_mlp_trains_like_cpu():
    assert N == 4
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref).to("xla")
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    placed = {}

    def tensor_parallel(name, mod, dm):
        # fc1 column-parallel (output features split), fc2 row-parallel (input features split).
        if name == "fc1":
            placed["fc1.weight"] = distribute_tensor(mod.weight, dm, [Shard(0)])
            placed["fc1.bias"] = distribute_tensor(mod.bias, dm, [Shard(0)])
        elif name == "fc2":
            placed["fc2.weight"] = distribute_tensor(mod.weight, dm, [Shard(1)])
            placed["fc2.bias"] = distribute_tensor(mod.bias, dm, [Replicate()])

    model = distribute_module(model, mesh, tensor_parallel)
    assert placed["fc1.weight"].placements == (Shard(0),)
    assert placed["fc2.weight"].placements == (Shard(1),)
    assert spec(model.fc1.weight) == "{devices=[4,1]0,1,2,3}"
    assert spec(model.fc2.weight) == "{devices=[1,4]0,1,2,3}"

    data = _data()
    want = _train_cpu(ref, data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for x, y in data:
        xd = distribute_tensor(x, mesh, [Replicate()])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xd), y.to("xla"))
        loss.backward()
        opt.step()
        xm.mark_step()
        got.append(loss.item())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6, msg=name)
    # The layouts survive the optimizer's updates.
    assert spec(model.fc1.weight) == "{devices=[4,1]0,1,2,3}"
    assert spec(model.fc2.weight) == "{devices=[1,4]0,1,2,3}"


def test_dtensor_operands_carry_gradients_to_parameters():
    torch.manual_seed(1)
    w1, w2, x = torch.randn(16, 32), torch.randn(8, 16), torch.rand(2, 32)
    ref1, ref2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    (torch.relu(x @ ref1.T) @ ref2.T).square().sum().backward()

    p1, p2 = w1.to("xla").requires_grad_(), w2.to("xla").requires_grad_()
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    d1 = distribute_tensor(p1, mesh, [Shard(0)])
    d2 = distribute_tensor(p2, mesh, [Shard(1)])
    dx = distribute_tensor(x, mesh, [Replicate()])
    out = torch.relu(torch.matmul(dx, d1.T)) @ d2.T
    assert isinstance(out, XLAShardedTensor)
    out.square().sum().backward()
    torch.testing.assert_close(out.cpu().global_tensor, torch.relu(x @ w1.T) @ w2.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p1.grad.cpu(), ref1.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(p2.grad.cpu(), ref2.grad, rtol=1e-4, atol=1e-4)


def test_cpu_copy_carries_its_global_tensor():
    t = torch.randn(8, 4, requires_grad=True)
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    d = distribute_tensor(t, mesh, [Shard(0)])
    c = (d * 2).cpu()
    # A plain CPU tensor (comparable with PyTorch's tools) that also answers `global_tensor`.
    assert type(c) is torch.Tensor and c.device.type == "cpu"
    torch.testing.assert_close(c, t * 2)
    np.testing.assert_allclose(c.global_tensor.numpy(), (t * 2).detach().numpy(), rtol=1e-6)


# ---- Partial placements -----------------------------------------------------------------

def test_partial_sum_distribute_and_reduce_to_replicate():
    torch.manual_seed(2)
    t = torch.randn(8, 6)
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    p = distribute_tensor(t, mesh, [Partial()])
    assert p.placements == (Partial("sum"),)
    assert p._spec.tensor_meta.shape == t.shape
    # Each device holds PyTorch's partial value of the tensor.
    want_piece = Partial()._partition_value(t, mesh, 0)
    shards = p.local_shards
    assert len(shards) == N
    for s in shards:
        torch.testing.assert_close(s.data, want_piece)
    r = p.redistribute(mesh, [Replicate()])
    assert r.placements == (Replicate(),)
    torch.testing.assert_close(r.global_tensor.cpu(), t, rtol=1e-6, atol=1e-6)
    assert spec(r.global_tensor) == "{replicated}"
    # Used as a plain value, a Partial tensor is its reduction.
    torch.testing.assert_close((p * 3).cpu().global_tensor, t * 3, rtol=1e-6, atol=1e-6)


def test_partial_to_shard_is_reduced_and_laid_out():
    torch.manual_seed(3)
    t = torch.randn(8, 6)
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    p = distribute_tensor(t, mesh, [Partial()])
    s = p.redistribute(mesh, [Shard(0)])
    torch_xla.sync()
    assert s.placements == (Shard(0),)
    assert s.sharding_spec == "{devices=[4,1]0,1,2,3}"
    torch.testing.assert_close(s.global_tensor.cpu(), t, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([x.data for x in s.local_shards]), t, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_partial_other_reductions(op):
    t = torch.randn(4, 5)
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    p = distribute_tensor(t, mesh, [Partial(op)])
    for s in p.local_shards:
        torch.testing.assert_close(s.data, Partial(op)._partition_value(t, mesh, 0))
    torch.testing.assert_close(p.full_tensor().cpu(), t)


def test_partial_product_cannot_be_distributed():
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    with pytest.raises(ValueError, match=r"Replicate to Partial\(product\) conversion is not supported"):
        distribute_tensor(torch.randn(4), mesh, [Partial("product")])


def test_partial_on_a_2d_mesh():
    t = torch.randn(8, 6)
    mesh = init_device_mesh("xla", mesh_shape=(2, 2))
    p = distribute_tensor(t, mesh, [Partial(), Shard(0)])
    assert p.placements == (Partial("sum"), Shard(0))
    # Each device: its half of the rows, halved (sum over the 2 devices of mesh dim 0).
    pieces = [s.data for s in p.local_shards]
    assert [tuple(x.shape) for x in pieces] == [(4, 6)] * 4
    halves = (t / 2).chunk(2)
    torch.testing.assert_close(pieces[0], halves[0])
    torch.testing.assert_close(pieces[1], halves[1])
    r = p.redistribute(mesh, [Replicate(), Shard(0)])
    assert r.placements == (Replicate(), Shard(0))
    torch.testing.assert_close(r.global_tensor.cpu(), t, rtol=1e-6, atol=1e-6)
    # Keeping the Partial dimension: nothing is reduced yet.
    k = p.redistribute(mesh, [Partial(), Replicate()])
    assert k.placements == (Partial("sum"), Replicate())
    torch.testing.assert_close(k.full_tensor().cpu(), t, rtol=1e-6, atol=1e-6)


def test_partial_gradient_reaches_the_source():
    w = torch.randn(4, 3)
    ref = w.clone().requires_grad_()
    (sum([ref / N] * N) * torch.arange(3.)).sum().backward()
    x = w.to("xla").requires_grad_()
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    p = distribute_tensor(x, mesh, [Partial()])
    (p.full_tensor() * torch.arange(3.).to("xla")).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), ref.grad)


def test_from_local_partial_row_parallel_linear():
    """A row-parallel linear in a manual region: each device's product is a partial sum."""
    torch.manual_seed(4)
    x, w1, w2 = torch.randn(2, 32), torch.randn(16, 32), torch.randn(8, 16)
    want = torch.relu(x @ w1.T) @ w2.T
    mesh = xs.Mesh(np.arange(N), (N,))
    xx, ww1, ww2 = x.to("xla"), w1.to("xla"), w2.to("xla")
    xs.mark_sharding(ww1, mesh, (0, None))
    xs.mark_sharding(ww2, mesh, (None, 0))
    l1 = xs.enable_manual_sharding(ww1, (0, None), mesh=mesh).global_tensor
    l2 = xs.enable_manual_sharding(ww2, (None, 0), mesh=mesh).global_tensor
    assert tuple(l1.shape) == (4, 32) and tuple(l2.shape) == (8, 4)
    local = torch.relu(xx @ l1.T) @ l2.T  # xx: the same on every device
    y = XLAShardedTensor.from_local(local, mesh, [Partial()])
    assert y.placements == (Partial("sum"),)
    # The pieces are each device's own partial product.
    for i, s in enumerate(y.local_shards):
        k = slice(4 * i, 4 * i + 4)
        torch.testing.assert_close(s.data, torch.relu(x @ w1[k].T) @ w2[:, k].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.redistribute(mesh, [Replicate()]).global_tensor.cpu(), want,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.redistribute(mesh, [Shard(1)]).global_tensor.cpu(), want,
                               rtol=1e-5, atol=1e-5)


def test_from_local_shard_and_replicate():
    t = torch.arange(32.).reshape(8, 4)
    mesh = xs.Mesh(np.arange(N), (N,))
    g = t.to("xla")
    xs.mark_sharding(g, mesh, (0, None))
    local = xs.enable_manual_sharding(g, (0, None), mesh=mesh).global_tensor * 2
    s = XLAShardedTensor.from_local(local, mesh, [Shard(0)])
    assert s.placements == (Shard(0),) and tuple(s.shape) == (8, 4)
    torch.testing.assert_close(s.global_tensor.cpu(), t * 2)
    # A plain tensor is every device's local value.
    r = XLAShardedTensor.from_local(torch.ones(2, 3), mesh, [Shard(1)])
    torch.testing.assert_close(r.global_tensor.cpu(), torch.ones(2, 3 * N))
    with pytest.raises(ValueError, match="shape"):
        XLAShardedTensor.from_local(torch.ones(2, 3), mesh, [Shard(1)], shape=(2, 3))


def test_redistribute_errors():
    mesh = xs.Mesh(np.arange(N), (N,))
    d = xs.mark_sharding(torch.randn(8, 16).to("xla"), mesh, (0, None))
    with pytest.raises(IndexError):
        d.redistribute(mesh, [Shard(2)])
    with pytest.raises(ValueError):
        d.redistribute(mesh, [Shard(0), Shard(1)])
    # PyTorch refuses redistributing to Partial with a RuntimeError; PyTorch/XLA with a
    # NotImplementedError (a RuntimeError too).
    with pytest.raises(NotImplementedError, match="Partial"):
        d.redistribute(mesh, [Partial()])
    with pytest.raises(RuntimeError, match="placements is needed"):
        d.redistribute(mesh, None)
    p = distribute_tensor(torch.randn(8), init_device_mesh("xla", mesh_shape=(N,)), [Partial("max")])
    with pytest.raises(NotImplementedError):
        p.redistribute(mesh, [Partial("sum")])
    dm2 = init_device_mesh("xla", mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="Mixed Partial reduce types"):
        distribute_tensor(torch.randn(4), dm2, [Partial("sum"), Partial("max")])
    both = distribute_tensor(torch.ones(4), dm2, [Partial("sum"), Partial("avg")])  # sum and avg commute
    torch.testing.assert_close(both.full_tensor().cpu(), torch.ones(4))


# ---- the DTensorSpec view ---------------------------------------------------------------

def test_spec_matches_pytorch_and_follows_resharding():
    t = torch.randn(8, 4).to("xla")
    w = wrap_as_sharded_tensor(t, mesh_shape=(N,), partition_spec=(0, None))
    s1 = w._spec
    assert w._cached_spec is s1
    want = DTensorSpec(mesh=DeviceMesh("xla", torch.arange(N)), placements=(Shard(0),),
                       tensor_meta=TensorMeta(shape=torch.Size([8, 4]), stride=(4, 1), dtype=torch.float32))
    assert (s1.mesh, s1.placements, s1.tensor_meta, s1.shard_order) == (
        want.mesh, want.placements, want.tensor_meta, want.shard_order)
    w2 = wrap_as_sharded_tensor(w, mesh_shape=(2, 2), partition_spec=(0, 1))
    assert w2._spec is not s1
    assert w2._spec.placements == (Shard(0), Shard(1))
    assert w2._spec.mesh.shape == (2, 2)
    assert w2._spec.shard_order == (ShardOrderEntry(0, (0,)), ShardOrderEntry(1, (1,)))
    # One dimension split over both mesh dims, mesh dim 1 first.
    w3 = wrap_as_sharded_tensor(w2, partition_spec=((1, 0), None))
    assert w3._spec.placements == (Shard(0), Shard(0))
    assert w3._spec.shard_order == (ShardOrderEntry(0, (1, 0)),)


# ---- distribute_module with auto_policy -------------------------------------------------

def test_distribute_module_auto_policy_moves_module_and_trains_like_cpu():
    assert not torch_xla._XLAC._xla_get_auto_sharding()
    torch.manual_seed(5)
    ref = MLP()
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("xla", mesh_shape=(N,))
    try:
        met.clear_counters()
        model = distribute_module(model, mesh, xs.auto_policy)
        assert torch_xla._XLAC._xla_get_auto_sharding()
        assert all(p.device.type == "xla" for p in model.parameters())
        data = _data(3, seed=1)
        want = _train_cpu(ref, data)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        got = []
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to("xla")), y.to("xla"))
            loss.backward()
            opt.step()
            xm.mark_step()
            got.append(loss.item())
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6)
        assert met.counter_value("CompileWithAutoSharding") >= 1
        with pytest.raises(RuntimeError, match="on the CPU"):
            distribute_module(model, mesh, xs.auto_policy)
    finally:
        import os
        os.environ.pop("XLA_AUTO_SPMD", None)
        auto_sharding.disable()
