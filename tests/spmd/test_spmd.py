"""SPMD against eager CPU: layouts, sharded training, zero recompiles, errors."""
import copy
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from models import Decoder, ResidualBlock, lm_data, lm_loss, mlp, mlp_batches, train_classifier

N = xr.global_runtime_device_count()


def mesh(shape, names=None):
    return xs.Mesh(np.arange(N), shape, names)


def test_runtime_view():
    assert xr.is_spmd() and N == 4
    assert xr.addressable_runtime_device_count() == 4
    attrs = xr.global_runtime_device_attributes()
    assert [a["name"] for a in attrs] == [f"CPU:{i}" for i in range(4)]
    assert torch_xla.device() == torch.device("xla:0")


def test_mesh_api_and_errors():
    m = mesh((2, 2), ("data", "model"))
    assert list(m.shape().items()) == [("data", 2), ("model", 2)]
    assert m.size() == 4 and m.get_axis_name_idx("model") == 1
    assert m.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    assert m.get_jax_mesh().shape == {"data": 2, "model": 2}
    with pytest.raises(AssertionError, match="mesh size"):
        xs.Mesh(np.arange(4), (2, 4))
    with pytest.raises(ValueError, match="global number of devices"):
        xs.Mesh(np.arange(2), (2,))
    t = torch.zeros(4, 4, device="xla")
    with pytest.raises(ValueError, match="Partition spec length"):
        xs.mark_sharding(t, m, ("data",))
    with pytest.raises(ValueError, match="'batch' is not in the mesh"):
        xs.mark_sharding(t, m, ("batch", None))
    with pytest.raises(ValueError, match="used twice"):
        xs.mark_sharding(t, m, ("data", "data"))
    g = xs.get_1d_mesh("x")
    assert g.mesh_shape == (4,) and g.axis_names == ("x",)
    xs.set_global_mesh(m)
    assert xs.get_global_mesh() is m


def test_hybrid_mesh_single_host():
    hm = xs.HybridMesh(ici_mesh_shape=(2, 2), axis_names=("a", "b"))
    assert hm.mesh_shape == (2, 2) and sorted(hm.device_ids.tolist()) == [0, 1, 2, 3]
    t = torch.arange(16.).reshape(4, 4)
    x = t.to("xla")
    xs.mark_sharding(x, hm, ("a", "b"))
    torch.testing.assert_close((x * 2).cpu(), t * 2)


@pytest.mark.parametrize("shape,spec,text", [
    ((4, 1), (0, 1), "{devices=[4,1]0,1,2,3}"),
    ((1, 4), (0, 1), "{devices=[1,4]0,1,2,3}"),
    ((2, 2), (None, 1), "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"),
    ((2, 2), ((0, 1), None), "{devices=[4,1]0,1,2,3}"),
    ((4,), (None, None), "{replicated}"),
])
def test_sharding_text_and_shards(shape, spec, text):
    t = torch.arange(64.).reshape(8, 8)
    x = t.to("xla")
    xst = xs.mark_sharding(x, mesh(shape), spec)
    assert torch_xla._XLAC._get_xla_sharding_spec(x) == text
    shards = xst.local_shards
    assert len(shards) == 4
    for s in shards:
        torch.testing.assert_close(s.unpadded_data, t[s.indices if s.indices is Ellipsis else tuple(s.indices)])
    # The device buffers really hold the pieces: each device has its shard's shape.
    arr = torch_xla._engine.tensor.state_of(x).node.array
    assert sorted(tuple(s.data.shape) for s in arr.addressable_shards) == sorted(
        tuple(s.data.shape) for s in shards)
    torch.testing.assert_close(x.cpu(), t)


def test_uneven_dimension_is_padded():
    t = torch.arange(5.)
    x = t.to("xla")
    xst = xs.mark_sharding(x, mesh((4,)), (0,))
    shards = xst.local_shards
    assert [tuple(s.data.shape) for s in shards] == [(2,)] * 4
    torch.testing.assert_close(torch.cat([s.unpadded_data for s in shards]), t)
    torch.testing.assert_close((x + 1).cpu(), t + 1)


def test_load_local_shards():
    t = torch.arange(8.)
    x = t.to("xla")
    xst = xs.mark_sharding(x, mesh((4,)), (0,))
    shards = xst.local_shards
    for s in shards:
        s.data *= -1
    xst.load_local_shards_(shards)
    torch.testing.assert_close(x.cpu(), -t)
    with pytest.raises(RuntimeError):
        xst.load_local_shards_(shards[:-1])


def test_pending_value_and_inplace_keep_annotation():
    t = torch.randn(8, 8)
    x = t.to("xla")
    y = x @ x
    xs.mark_sharding(y, mesh((4, 1)), (0, None))
    spec = torch_xla._XLAC._get_xla_sharding_spec(y)
    assert spec == "{devices=[4,1]0,1,2,3}"
    y.add_(1)
    xm.mark_step()
    assert torch_xla._XLAC._get_xla_sharding_spec(y) == spec
    arr = torch_xla._engine.tensor.state_of(y).node.array
    assert {tuple(s.data.shape) for s in arr.addressable_shards} == {(2, 8)}
    torch.testing.assert_close(y.cpu(), t @ t + 1, rtol=1e-5, atol=1e-5)


def test_clear_sharding_and_clone():
    x = torch.randn(4, 8).to("xla")
    xs.mark_sharding(x, mesh((1, 4)), (0, 1))
    assert torch_xla._XLAC._get_xla_sharding_spec(x)
    xs.clear_sharding(x)
    assert torch_xla._XLAC._get_xla_sharding_spec(x) == ""
    xs.mark_sharding(x, mesh((1, 4)), (0, 1))
    with pytest.raises(RuntimeError, match="already sharded"):
        xs.mark_sharding(x, mesh((4, 1)), (0, 1))
    xs.mark_sharding(x, mesh((1, 4)), (0, 1))  # the same annotation again is fine


def _mlp():
    return mlp(32, 32)


def _train(model, shard, steps, batch, on_step=None):
    step = iter(range(steps))

    def prepare(x, y):
        if on_step is not None:
            on_step(next(step))
        return shard(x, y) if shard is not None else (x, y)
    losses = train_classifier(model, mlp_batches(steps, batch), prepare, xm.mark_step if shard is not None else None)
    return losses, model


@pytest.mark.parametrize("layout", ["data4", "data2_model2"])
def test_mlp_training_matches_cpu(layout):
    ref_losses, ref = _train(_mlp(), None, 20, 16)
    model = _mlp().to("xla")
    if layout == "data4":
        m = mesh((4,), ("data",))
        bspec = ("data", None)
    else:
        m = mesh((2, 2), ("data", "model"))
        bspec = ("data", None)
        xs.mark_sharding(model[0].weight, m, ("model", None))
        xs.mark_sharding(model[2].weight, m, (None, "model"))

    def shard(x, y):
        x, y = x.to("xla"), y.to("xla")
        xs.mark_sharding(x, m, bspec)
        xs.mark_sharding(y, m, ("data",))
        return x, y
    losses, model = _train(model, shard, 20, 16)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    if layout == "data2_model2":
        assert torch_xla._XLAC._get_xla_sharding_spec(model[0].weight) == \
            "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"


def test_steady_loop_compiles_nothing_new():
    model = _mlp().to("xla")
    m = mesh((4,), ("data",))
    xs.mark_sharding(model[0].weight, m, ("data", None))

    def shard(x, y):
        x, y = x.to("xla"), y.to("xla")
        xs.mark_sharding(x, m, ("data", None))
        return x, y
    seen = {}

    def count(i):
        seen[i] = met.counter_value("UncachedCompile") or 0
    _train(model, shard, 10, 16, on_step=count)
    xm.mark_step()
    assert seen[3] > 0
    assert seen[9] == seen[3], seen


def test_loader_input_sharding():
    m = mesh((4,), ("data",))
    spec = xs.ShardingSpec(m, ("data", None))
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    loader = pl.MpDeviceLoader(batches, torch_xla.device(), input_sharding=spec)
    seen = 0
    for (x, y), (cx, cy) in zip(loader, batches):
        assert torch_xla._XLAC._get_xla_sharding_spec(x) == "{devices=[4,1]0,1,2,3}"
        torch.testing.assert_close(x.cpu(), cx)
        torch.testing.assert_close(y.cpu(), cy)
        seen += 1
    assert seen == 3


def test_decoder_2x2_matches_cpu():
    torch.manual_seed(0)
    ref = Decoder(n_layers=1)
    model = copy.deepcopy(ref).to("xla")
    m = mesh((2, 2), ("data", "model"))
    for name, p in model.named_parameters():
        if p.dim() == 2 and p.shape[0] % 2 == 0:
            xs.mark_sharding(p, m, ("model", None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for idx, tgt in lm_data(4):
        ropt.zero_grad()
        rl = lm_loss(ref(idx), tgt)
        rl.backward()
        ropt.step()
        x, y = idx.to("xla"), tgt.to("xla")
        xs.mark_sharding(x, m, ("data", None))
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        xm.mark_step()
        np.testing.assert_allclose(float(loss), float(rl), rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-3, atol=1e-4)


def test_dtensor_distribute_tensor():
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    dm = init_device_mesh("xla", mesh_shape=(4,))
    t = torch.randn(12, 3)
    d = distribute_tensor(t.to("xla"), dm, [Shard(0)])
    assert type(d).__name__ == "XLAShardedTensor"
    assert d.sharding_spec == "{devices=[4,1]0,1,2,3}"
    assert [tuple(s.data.shape) for s in d.local_shards] == [(3, 3)] * 4
    torch.testing.assert_close(d.global_tensor.cpu(), t)
    torch.testing.assert_close((d * 2).cpu(), t * 2)


def test_mark_sharding_with_gradients_annotates_the_gradient():
    m = mesh((4,), ("x",))
    t = torch.randn(8, 4)
    x = t.to("xla").requires_grad_(True)
    y = xs.mark_sharding_with_gradients(x * 1, m, ("x", None))
    (y.sum() * 3).backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((8, 4), 3.0))


def test_global_tensor_from_cpu_shards():
    m = mesh((2, 2))
    t = torch.arange(20.).reshape(4, 5)
    sh = m.get_op_sharding((0, 1))
    x = t.to("xla")
    shards = xs.mark_sharding(x, m, (0, 1)).local_shards  # padded: 5 columns over 2
    g = torch_xla._XLAC._global_tensor_from_cpu_shards([s.data for s in shards], sh, t.shape)
    torch.testing.assert_close(g.cpu(), t)
    assert torch_xla._XLAC._get_xla_sharding_spec(g) == "{devices=[2,2]0,1,2,3}"
    with pytest.raises(RuntimeError):
        torch_xla._XLAC._global_tensor_from_cpu_shards([s.data for s in shards[:-1]], sh, t.shape)


def test_minibatch_needs_divisible_host_batch():
    spec = xs.ShardingSpec(mesh((4,), ("data",)), ("data", None), minibatch=True)
    x = xm.send_cpu_data_to_device([torch.ones(8, 2)], torch_xla.device(), input_sharding=spec)[0]
    torch.testing.assert_close(x.cpu(), torch.ones(8, 2))
    with pytest.raises(RuntimeError, match="divisible by local runtime device count"):
        xm.send_cpu_data_to_device([torch.ones(6, 2)], torch_xla.device(), input_sharding=spec)


@pytest.mark.parametrize("specs", [((0, 1), (0, None)), ((1, 0), (None, None))])
def test_2x2_layouts_train_with_adamw_like_cpu(specs):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    model = copy.deepcopy(ref).to("xla")
    m = mesh((2, 2))
    xs.mark_sharding(model[0].weight, m, specs[0])
    xs.mark_sharding(model[2].weight, m, specs[1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = torch.randn(8, 16, generator=g)
        ropt.zero_grad()
        ref(x).square().mean().backward()
        ropt.step()
        opt.zero_grad()
        model(x.to("xla")).square().mean().backward()
        opt.step()
        xm.mark_step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


def test_manual_sharding_region_matches_cpu():
    m = mesh((1, 4))
    xs.set_global_mesh(m)
    t = torch.arange(32.).reshape(8, 4)
    x = t.to("xla")
    xx = xs.enable_manual_sharding(x, (None, 1))
    assert tuple(xx.shape) == (8, 1) and xx.sharding_spec == "{manual}"
    assert xx.sharding_type == xs.ShardingType.MANUAL
    # Per device: its column's cumulative sum, then back to a global (8, 4) tensor.
    y = torch.cumsum(xx.global_tensor, 0) * 2
    z = xs.disable_manual_sharding(y, (None, 1), (8, 4))
    assert z.sharding_spec == "{devices=[1,4]0,1,2,3}"
    torch.testing.assert_close(z.global_tensor.cpu(), torch.cumsum(t, 0) * 2)
    with pytest.raises(RuntimeError, match="device data"):
        xs._mark_manual_sharding(torch.zeros(2, 2).to("xla"))
    with pytest.raises(RuntimeError, match="not manually sharded"):
        torch_xla._XLAC._spmd_shard_to_full_shape(x + 1, m.get_op_sharding((None, 1)), (8, 4), x.dtype)


def test_per_device_value_cannot_leave_its_region():
    m = mesh((4,))
    x = torch.ones(8).to("xla")
    xs.mark_sharding(x, m, (0,))
    inside = torch_xla._XLAC._spmd_full_to_shard_shape(x) + 1
    with pytest.raises(RuntimeError, match="manual sharding region"):
        inside.cpu()


def test_unfinished_region_prints_as_spmd_custom_calls_and_still_cannot_run():
    m = mesh((4,))
    x = torch.ones(8).to("xla")
    xs.mark_sharding(x, m, (0,))
    inside = torch_xla._XLAC._spmd_full_to_shard_shape(x) + 1
    marked = xs._mark_manual_sharding(x * 2)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([inside, marked.global_tensor])
    assert ('f32[2]{0} custom-call(f32[8]{0} %p0.1), custom_call_target="SPMDFullToShardShape", '
            'sharding={manual}') in hlo
    assert 'custom_call_target="Sharding", sharding={manual}' in hlo
    with pytest.raises(RuntimeError, match="manual sharding region"):
        inside.cpu()
    # A finished region runs as before, and its text is the program that runs.
    y = xs.disable_manual_sharding(inside, (0,), (8,), mesh=m)
    assert "SPMDFullToShardShape" not in torch_xla._XLAC._get_xla_tensors_hlo([y.global_tensor])
    torch.testing.assert_close(y.global_tensor.cpu(), torch.full((8,), 2.0))


def test_hlo_text_names_and_device_lists_match_the_sharding_spec():
    x = torch.randn(4, 8, 8).to("xla")
    xs.mark_sharding(x, mesh((2, 2)), (1, None, 0))  # a transposed device order
    spec = torch_xla._XLAC._get_xla_sharding_spec(x)
    assert spec == "{devices=[2,1,2]0,2,1,3}"
    y = xs.annotate_custom_sharding(x.exp(), mesh((4, 1)), (0, None, None))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([y.global_tensor])
    assert f"%p0.1 = f32[4,8,8]{{2,1,0}} parameter(0), sharding={spec}" in hlo
    assert "%exponential.2 = f32[4,8,8]{2,1,0} exponential(f32[4,8,8]{2,1,0} %p0.1)" in hlo
    assert ('custom-call(f32[4,8,8]{2,1,0} %exponential.2), custom_call_target="Sharding", '
            'sharding={devices=[4,1,1]0,1,2,3}') in hlo
    assert "<=[" not in hlo
    torch.testing.assert_close(y.global_tensor.cpu(), x.cpu().exp())


def test_backward_optimization_barrier_holds_the_layer_gradients_like_cpu():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    model = copy.deepcopy(ref).to("xla")
    xs.apply_backward_optimization_barrier(model[2])
    x = torch.randn(4, 16)
    ref(x).sum().backward()
    model(x.to("xla")).sum().backward()
    # One barrier over the layer's weight and bias gradients and the gradient leaving it.
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([model[2].weight.grad])
    assert re.search(r"opt-barrier\(\(f32\[2,8\]\{[01,]+\}, f32\[2\]\{0\}, f32\[4,8\]\{1,0\}\)", hlo)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)


def test_hlo_text_shows_the_layout_an_inplace_update_keeps():
    t = torch.arange(32.).reshape(4, 8)
    x = t.to("xla")
    xs.mark_sharding(x, mesh((1, 4)), (0, 1))
    x.add_(1)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([x])
    assert ('custom-call(f32[4,8]{1,0} %add.4), custom_call_target="Sharding", '
            'sharding={devices=[1,4]0,1,2,3}') in hlo
    assert torch_xla._XLAC._get_xla_sharding_spec(x) == "{devices=[1,4]0,1,2,3}"
    torch.testing.assert_close(x.cpu(), t + 1)


def test_user_guide_samples_as_written():
    num_devices = xr.global_runtime_device_count()
    mesh_shape = (num_devices, 1)
    device_ids = np.array(range(num_devices))
    m = xs.Mesh(device_ids, mesh_shape, ("data", "model"))
    t = torch.randn(8, 4).to(xm.xla_device())
    partition_spec = ("data", "model")
    xs.mark_sharding(t, m, partition_spec)
    assert str(m.shape()) == "OrderedDict([('data', 4), ('model', 1)])"
    device = torch_xla.device()
    t1 = torch.randn(8, 8, 16).to(device)
    t2 = torch.randn(8).to(device)
    xs.mark_sharding(t1, m, (None, "data", "model"))
    xs.mark_sharding(t2, m, ("data",))
    xs.mark_sharding(t2, m, (("data", "model"),))
    assert torch_xla._XLAC._get_xla_sharding_spec(t1) == "{devices=[1,4,1]0,1,2,3}"
    assert torch_xla._XLAC._get_xla_sharding_spec(t2) == "{devices=[4]0,1,2,3}"
    torch.testing.assert_close((t1.sum(2) @ t2.reshape(8, 1)).cpu(), t1.cpu().sum(2) @ t2.cpu().reshape(8, 1),
                               rtol=1e-5, atol=1e-4)


def test_abandoned_per_device_value_does_not_break_the_barrier():
    m = mesh((4,))
    x = torch.ones(8).to("xla")
    xs.mark_sharding(x, m, (0,))
    left = torch_xla._XLAC._spmd_full_to_shard_shape(x) * 3  # never leaves its region
    y = x + 1
    xm.mark_step()
    torch.testing.assert_close(y.cpu(), torch.full((8,), 2.0))
    assert tuple(left.shape) == (2,)


def test_torch_compile_on_sharded_inputs_and_mark_sharding_inside():
    m = mesh((4, 1), ("data", "model"))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model = copy.deepcopy(ref).to("xla")
    xs.mark_sharding(model[0].weight, m, ("data", None))
    compiled = torch.compile(model, backend="openxla")
    x = torch.randn(8, 16)
    xx = x.to("xla")
    xs.mark_sharding(xx, m, ("data", None))
    with torch.no_grad():
        torch.testing.assert_close(compiled(xx).cpu(), ref(x), rtol=1e-5, atol=1e-5)

    def f(t):
        y = t * 2
        xs.mark_sharding(y, m, ("data", None))  # a graph break: runs between the two graphs
        return y + 1
    r = torch.compile(f, backend="openxla")(xx)
    torch.testing.assert_close(r.cpu(), x * 2 + 1)
    assert torch_xla._XLAC._get_xla_sharding_spec(r) == "{devices=[4,1]0,1,2,3}"


def test_visualize_tensor_sharding_shows_each_devices_tile():
    import rich.console
    from torch_xla.distributed.spmd.debugging import visualize_sharding, visualize_tensor_sharding
    x = torch.zeros(8, 8).to("xla")
    xs.mark_sharding(x, mesh((2, 2)), (0, 1))
    console = rich.console.Console(width=80)
    with console.capture() as cap:
        console.print(visualize_tensor_sharding(x, use_color=False))
    text = cap.get()
    for d in range(4):
        assert f"CPU {d}" in text
    with console.capture() as cap:
        console.print(visualize_sharding("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}", use_color=False))
    assert "CPU [0, 1]" in cap.get() and "CPU [2, 3]" in cap.get()
    with pytest.raises(ValueError, match="cannot read"):
        visualize_sharding("{maximal device=0}")


def test_mark_sharding_function_under_aot_autograd_is_a_graph_op():
    from functorch.compile import aot_function, make_boxed_func
    from torch_xla.distributed.spmd.xla_sharding import MarkShardingFunction
    m = mesh((4,))
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    def f(x):
        return MarkShardingFunction.apply(torch.sin(x), m, (0,)) * 3

    t = torch.randn(8)
    x = t.to("xla").requires_grad_(True)
    y = aot_function(f, keep)(x)
    y.sum().backward()
    xm.mark_step()
    torch.testing.assert_close(y.cpu(), torch.sin(t) * 3)
    torch.testing.assert_close(x.grad.cpu(), torch.cos(t) * 3)
    assert torch_xla._XLAC._get_xla_sharding_spec(y) == "{devices=[4]0,1,2,3}"
    assert torch_xla._XLAC._get_xla_sharding_spec(x.grad) == "{devices=[4]0,1,2,3}"
    assert all("xla.mark_sharding" in g.code for g in graphs)


def test_manual_region_refuses_an_uneven_dimension():
    m = mesh((4,))
    x = torch.arange(5.).to("xla")
    with pytest.raises(RuntimeError, match="split evenly"):
        xs.enable_manual_sharding(x, (0,), mesh=m)
    torch.testing.assert_close((x * 2).cpu(), torch.arange(5.) * 2)  # padded layout still computes


def test_every_host_read_of_spmd_device_data_counts_as_replicate_sharded_data():
    # Device data of the SPMD device, sharded or replicated, read back as one tensor counts
    # once per read; data still on the host (never used by a program) does not.
    t = torch.arange(32.).reshape(8, 4)
    x = t.to("xla")
    met.clear_all()
    assert torch.equal(x.cpu(), t)
    assert not met.counter_value("ReplicateShardedData")
    xs.mark_sharding(x, mesh((4, 1)), (0, 1))
    y = (x * 2).sum(0)
    xm.mark_step()
    assert torch.equal(x.cpu(), t) and torch.equal(y.cpu(), (t * 2).sum(0))
    assert met.counter_value("ReplicateShardedData") == 2


def test_host_data_goes_to_the_devices_at_its_annotation_or_first_use():
    # Data sent to the SPMD device waits on the host: an annotation sends each device only
    # its piece; an op using it sends it replicated, at once (not at the barrier).
    import torch_xla._XLAC as X
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    xa, xb = a.to("xla"), b.to("xla")
    met.clear_all()
    assert "Tensor on host: with size [8, 4]" in X._get_xla_tensor_debug_info(xa)
    xs.mark_sharding(xa, mesh((4, 1)), (0, 1))
    assert met.counter_value("VirtualDeviceUsage") == 1
    assert [tuple(s.data.shape) for s in xs.XLAShardedTensor(xa).local_shards] == [(2, 4)] * 4
    assert "Tensor on host: with size [8, 4]" in X._get_xla_tensor_debug_info(xb)
    y = xb * 3
    info = X._get_xla_tensor_debug_info(xb)
    assert "Tensor on host: None" in info and "xla::device_data" in info
    assert met.counter_value("VirtualDeviceUsage") == 2
    torch.testing.assert_close((xa + y).cpu(), a + b * 3)


def test_ops_on_a_sharded_tensor_give_sharded_tensors_and_train_like_cpu():
    # Results of ops on an XLAShardedTensor are XLAShardedTensors over the result; autograd
    # runs through them, module backward hooks included, as through plain tensors.
    torch.manual_seed(0)
    ref = nn.Sequential(ResidualBlock(), ResidualBlock(), nn.Linear(16, 2))
    x_cpu = torch.randn(8, 16)
    ref(x_cpu).square().sum().backward()
    for hooked in (False, True):
        model = copy.deepcopy(ref).to("xla")
        model.zero_grad(set_to_none=True)
        if hooked:
            for b in model[:2]:
                b.register_full_backward_hook(lambda mod, gi, go: None)
        x = xs.mark_sharding(x_cpu.to("xla"), mesh((4, 1)), (0, None))
        out = model(x)
        assert isinstance(out, xs.XLAShardedTensor) and str(out).startswith("XLAShardedTensor(")
        assert not isinstance(out.global_tensor, xs.XLAShardedTensor)
        torch.testing.assert_close(out.cpu(), ref(x_cpu), rtol=1e-5, atol=1e-5)
        assert type(out.cpu()) is torch.Tensor
        out.square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5)
    leaf = xs.XLAShardedTensor(x_cpu.to("xla"), requires_grad=True)
    (leaf * 3).sum().backward()
    torch.testing.assert_close(leaf.grad.cpu(), torch.full_like(x_cpu, 3.))
