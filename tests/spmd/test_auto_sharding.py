"""Automatic sharding (`xr.use_spmd(auto=True)`) against eager CPU: results, the layouts
chosen, the compile counter, graph keys, the mesh variable, and turning it off."""
import copy
import os

import numpy as np
import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla._engine import auto_sharding
from models import mlp, mlp_batches, train_classifier

N = xr.global_runtime_device_count()


def _off():
    os.environ.pop("XLA_AUTO_SPMD", None)
    os.environ.pop("XLA_AUTO_SPMD_MESH", None)
    auto_sharding.disable()


@pytest.fixture
def auto():
    """Automatic sharding for one test; the rest of the session's SPMD tests run without."""
    assert not torch_xla._XLAC._xla_get_auto_sharding()
    xr.use_spmd(auto=True)
    try:
        yield
    finally:
        _off()


def spec(t) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def test_use_spmd_auto_sets_flag_and_env(auto):
    assert N == 4 and xr.is_spmd()
    assert torch_xla._XLAC._xla_get_auto_sharding()
    assert os.environ.get("XLA_AUTO_SPMD") == "1"
    # The environment variable alone keeps it on (as the original reads it).
    auto_sharding.disable()
    assert torch_xla._XLAC._xla_get_auto_sharding()
    os.environ.pop("XLA_AUTO_SPMD")
    assert not torch_xla._XLAC._xla_get_auto_sharding()


def test_matmul_matches_cpu_and_shards_inputs(auto):
    torch.manual_seed(0)
    a, b = torch.randn(64, 128), torch.randn(128, 256)
    small = torch.randn(4, 4)
    ref = (a @ b).sum() + small.sum()
    met.clear_counters()
    xa, xb, xs_ = a.to("xla"), b.to("xla"), small.to("xla")
    out = (xa @ xb).sum() + xs_.sum()
    torch_xla.sync()
    assert met.counter_value("CompileWithAutoSharding") == 1
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-3)
    # Large inputs are cut along their largest dimension over the 4 devices; a small one
    # stays replicated.
    assert spec(xa) == "{devices=[1,4]0,1,2,3}"
    assert spec(xb) == "{devices=[1,4]0,1,2,3}"
    assert spec(xs_) == ""
    assert met.counter_value("ReshardParameters") == 2
    # The same graph again on the laid-out data: compiled once more (its inputs have
    # another layout now), then cached.
    for _ in range(2):
        out = (xa @ xb).sum() + xs_.sum()
        torch_xla.sync()
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-3)
    assert met.counter_value("CompileWithAutoSharding") == 2
    assert met.counter_value("ReshardParameters") == 2


def test_mlp_training_matches_cpu(auto):
    cpu = mlp(256, 128)
    model = copy.deepcopy(cpu).to("xla")
    batches = mlp_batches(4, 64)
    ref = train_classifier(cpu, batches)
    met.clear_counters()
    got = train_classifier(model, batches, lambda x, y: (x.to("xla"), y.to("xla")), xm.mark_step)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    # Step 1, step 2 (momentum buffers appear), then cached.
    assert 1 <= met.counter_value("CompileWithAutoSharding") <= 3
    w1, w2, w3 = model[0].weight, model[2].weight, model[4].weight
    assert spec(w1) == "{devices=[4,1]0,1,2,3}"   # (256, 16): its rows
    assert spec(w2) == "{devices=[1,4]0,1,2,3}"   # (128, 256): its columns
    assert spec(w3) in ("", "{replicated}")        # (4, 128): 2 KiB, replicated


def test_graph_keys_differ_with_auto_and_mesh():
    xt = torch.ones(2, 2).to("xla")
    plain = torch_xla._XLAC._get_graph_hash([xt + 0])
    xr.use_spmd(auto=True)
    try:
        on = torch_xla._XLAC._get_graph_hash([xt + 0])
        assert on != plain
        os.environ["XLA_AUTO_SPMD_MESH"] = "2,2"
        on22 = torch_xla._XLAC._get_graph_hash([xt + 0])
        assert on22 != on and on22 != plain
        del os.environ["XLA_AUTO_SPMD_MESH"]
        assert torch_xla._XLAC._get_graph_hash([xt + 0]) == on
    finally:
        _off()
    # Off again: the plain program's key, and no compile counted as automatic.
    assert torch_xla._XLAC._get_graph_hash([xt + 0]) == plain
    met.clear_counters()
    a = torch.randn(64, 128)
    xa = a.to("xla")
    out = xa * 2
    torch_xla.sync()
    torch.testing.assert_close(out.cpu(), a * 2)
    assert not met.counter_value("CompileWithAutoSharding")
    assert spec(xa) == ""


def test_mesh_2x2_matches_cpu(auto):
    os.environ["XLA_AUTO_SPMD_MESH"] = "2,2"
    torch.manual_seed(1)
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    xa, xb = a.to("xla"), b.to("xla")
    out = torch.relu(xa @ xb)
    torch_xla.sync()
    torch.testing.assert_close(out.cpu(), torch.relu(a @ b), rtol=1e-5, atol=1e-4)
    # Each mesh axis of 2 goes to the dimension with the most left per device: (64, 128)
    # is cut in 2 x 2, (128, 32) in 4 rows.
    assert spec(xa) == "{devices=[2,2]0,2,1,3}"
    assert spec(xb) == "{devices=[4,1]0,1,2,3}"


def test_invalid_mesh_raises(auto):
    x = torch.randn(64, 128).to("xla")
    y = x * 3
    for bad in ("2,3", "4,x"):
        os.environ["XLA_AUTO_SPMD_MESH"] = bad
        with pytest.raises(RuntimeError, match="Invalid auto-sharding mesh_shape"):
            torch_xla.sync()
    os.environ.pop("XLA_AUTO_SPMD_MESH")
    torch.testing.assert_close(y.cpu(), x.cpu() * 3)


def test_annotated_layout_is_kept(auto):
    m = xs.Mesh(np.arange(N), (4,), ("data",))
    a = torch.randn(64, 128)
    xa = a.to("xla")
    xs.mark_sharding(xa, m, ("data", None))
    out = xa.sum(1)
    torch_xla.sync()
    torch.testing.assert_close(out.cpu(), a.sum(1), rtol=1e-5, atol=1e-4)
    assert spec(xa) == "{devices=[4,1]0,1,2,3}"


@pytest.mark.parametrize("shape,itemsize,mesh,want", [
    ((64, 128), 4, (4, 1), (None, "auto0")),
    ((128, 128), 4, (4, 1), ("auto0", None)),      # a tie: the first (batch) dimension
    ((4, 4), 4, (4, 1), (None, None)),              # below MIN_BYTES
    ((), 4, (4, 1), ()),
    ((4097, 7), 4, (4, 1), (None, None)),            # no dimension divides evenly
    ((6, 4096), 2, (4, 1), (None, "auto0")),
    ((64, 128), 4, (2, 2), ("auto1", "auto0")),
    ((8, 1024), 4, (2, 2), (None, ("auto0", "auto1"))),
    ((3, 3, 4096), 4, (1, 4), (None, None, "auto1")),
])
def test_rule(shape, itemsize, mesh, want):
    assert auto_sharding.spec_for(shape, itemsize, mesh) == want


def test_xla_cpu_ignores_its_auto_sharding_option():
    """Why the layouts are chosen in Python: XLA:CPU accepts `use_auto_spmd_partitioning`
    and leaves unannotated parameters replicated (docs/auto_sharding.md)."""
    import jax
    from jax._src import xla_bridge
    from jax._src.lib import xla_client as xc
    text = """module @m attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%a: tensor<64x128xf32>, %b: tensor<128x256xf32>) -> tensor<64x256xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<64x128xf32>, tensor<128x256xf32>) -> tensor<64x256xf32>
    return %0 : tensor<64x256xf32>
  }
}"""
    opts = xc.CompileOptions()
    opts.num_replicas, opts.num_partitions = 1, N
    build = opts.executable_build_options
    build.use_spmd_partitioning = True
    build.use_shardy_partitioner = False   # with Shardy, XLA:CPU aborts the process
    build.use_auto_spmd_partitioning = True
    build.auto_spmd_partitioning_mesh_shape = [N, 1]
    build.auto_spmd_partitioning_mesh_ids = list(range(N))
    build.allow_spmd_sharding_propagation_to_parameters = [True]
    build.allow_spmd_sharding_propagation_to_output = [True]
    opts.device_assignment = xc.DeviceAssignment.create(np.arange(N).reshape(1, N))
    devices = jax.devices()[:N]
    exe = xla_bridge.get_backend().compile_and_load(text, xc.DeviceList(tuple(devices)), opts)
    got = [str(xc.HloSharding.from_proto(s)) for s in exe.get_parameter_shardings()]
    assert got == ["{replicated}", "{replicated}"]
