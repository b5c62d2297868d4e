"""SPMD input loading (`MpDeviceLoader(input_sharding=...)`), the lowering context's
parameters, the graph dump's output shardings and the post-optimization HLO, with values
compared against eager CPU."""
import re

import numpy as np
import pytest
import torch

import torch_xla
import torch_xla._XLAC as _XLAC
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla._engine import env_vars
from torch_xla._engine.executor import dumps

N = xr.global_runtime_device_count()
ROW = "{devices=[%d,1]%s}" % (N, ",".join(map(str, range(N))))


def _first(loader):
    return next(iter(loader))


def test_loader_dict_of_specs_lays_out_each_key():
    mesh = xs.get_1d_mesh("x")
    batch = {"x": torch.randn(16, 8), "y": torch.randn(16, 4, 4)}
    loader = pl.MpDeviceLoader([batch], torch_xla.device(), input_sharding={
        "x": xs.ShardingSpec(mesh, ("x", None)), "y": xs.ShardingSpec(mesh, (None, None, "x"))})
    data = _first(loader)
    assert _XLAC._get_xla_sharding_spec(data["x"]) == ROW
    assert _XLAC._get_xla_sharding_spec(data["y"]) == "{devices=[1,1,%d]%s}" % (N, ",".join(map(str, range(N))))
    torch.testing.assert_close(data["x"].cpu(), batch["x"])
    torch.testing.assert_close((data["y"] * 2).sum(0).cpu(), (batch["y"] * 2).sum(0))


def test_loader_single_spec_applies_where_the_rank_fits():
    mesh = xs.get_1d_mesh("x")
    batch = (torch.randn(16, 8), torch.arange(16))   # the labels' rank does not fit the spec
    data = _first(pl.MpDeviceLoader([batch], torch_xla.device(), input_sharding=xs.ShardingSpec(mesh, ("x", None))))
    assert isinstance(data, tuple)
    assert _XLAC._get_xla_sharding_spec(data[0]) == ROW
    assert _XLAC._get_xla_sharding_spec(data[1]) == "{replicated}"
    torch.testing.assert_close((data[0] @ data[0].T).cpu(), batch[0] @ batch[0].T)
    assert torch.equal(data[1].cpu(), batch[1])


def test_loader_without_spec_replicates():
    batch = {"x": torch.randn(16, 8)}
    data = _first(pl.MpDeviceLoader([batch], torch_xla.device(), input_sharding=None))
    assert _XLAC._get_xla_sharding_spec(data["x"]) == "{replicated}"
    torch.testing.assert_close(data["x"].exp().cpu(), batch["x"].exp())


def test_loader_dict_spec_errors():
    mesh = xs.get_1d_mesh("x")
    spec = {"x": xs.ShardingSpec(mesh, ("x", None))}
    with pytest.raises(ValueError, match="input batch should be a dict"):
        _first(pl.MpDeviceLoader([torch.randn(16, 8)], torch_xla.device(), input_sharding=spec))
    with pytest.raises(KeyError, match=r"\['y'\] are missing from input_sharding"):
        _first(pl.MpDeviceLoader([{"x": torch.randn(16, 8), "y": torch.randn(16)}], torch_xla.device(),
                                 input_sharding=spec))


def _sharded_inputs():
    m = xs.Mesh(np.arange(N), (2, N // 2), ("x", "y"))
    a_cpu, b_cpu = torch.randn(8, 16), torch.randn(16)
    a, b = a_cpu.to("xla"), b_cpu.to("xla")
    xs.mark_sharding(a, m, ("x", "y"))
    xs.mark_sharding(b, m, ("x",))
    return a_cpu, b_cpu, a, b


def test_lowering_context_parameter_ids():
    a_cpu, b_cpu, a, b = _sharded_inputs()
    unused = torch.ones(3, device="xla")
    torch_xla.sync()
    result = a + b
    ctx = _XLAC.lowering.LoweringContext("Named")
    ctx.build([result])
    ia, ib = ctx.tensor_parameter_id(a), ctx.tensor_parameter_id(b)
    assert sorted([ia, ib]) == [0, 1]
    assert ctx.tensor_parameter_id(unused) == -1
    assert ctx.tensor_parameter_id(result) == -1   # pending: no device data
    mapping = ctx.device_parameter_id_tensor_mapping()
    assert len(mapping) == 2
    torch.testing.assert_close(mapping[ia].cpu(), a_cpu)
    torch.testing.assert_close(mapping[ib].cpu(), b_cpu)
    torch_xla.sync()
    assert ctx.tensor_parameter_id(a) == ia   # the same buffers after the barrier
    torch.testing.assert_close(result.cpu(), a_cpu + b_cpu)


def test_module_proto_text_names_ops_by_opcode():
    m = xs.Mesh(np.arange(N), (2, N // 2), ("x", "y"))
    z = torch.zeros(64, device="xla")
    xs.mark_sharding(z, m, ("x",))
    ctx = _XLAC.lowering.LoweringContext("Named")
    ctx.build([z + 1])
    comp = _XLAC._xla_op_computation_from_module_proto("mine", ctx.hlo())
    text = _XLAC._xla_computation_text(comp)
    spec = _XLAC._get_xla_sharding_spec(z)
    assert re.search(r"%custom-call\.\d+ = f32\[64\]\{0\} custom-call\(.*custom_call_target=\"Sharding\", "
                     rf"sharding={re.escape(spec)}", text), text
    assert "sharding_constraint" not in text and "<=[" not in text
    with pytest.raises(TypeError):
        _XLAC._xla_op_computation_from_module_proto("mine", "not bytes")
    torch_xla.sync()
    torch.testing.assert_close(z.cpu(), torch.zeros(64))


def test_dump_has_ordinal_suffix_and_output_shardings(tmp_path, monkeypatch):
    path = tmp_path / "graphs.txt"
    monkeypatch.setattr(dumps.settings, "on", True)
    a_cpu, b_cpu, a, b = _sharded_inputs()
    torch_xla.sync()
    with env_vars.overlay({"XLA_SAVE_TENSORS_FILE": str(path), "XLA_SAVE_TENSORS_FMT": "hlo"}):
        r1, r2 = a * 2, a.sum(0)
        torch_xla.sync()
    assert not path.exists()
    text = (tmp_path / "graphs.txt.0").read_text()
    lines = text.splitlines(keepends=True)
    assert lines[-2] == "#OUTPUT_SHARDING_END\n" and text.count("## END_GRAPH") == 1
    body = re.search(r"#OUTPUT_SHARDING_BEGIN\n\n(.*?)\n#OUTPUT_SHARDING_END", text, re.S).group(1)
    assert body.splitlines() == [f"f32[8,16] {_XLAC._get_xla_sharding_spec(r1)}",
                                 f"f32[16] {_XLAC._get_xla_sharding_spec(r2)}"]
    assert _XLAC._get_xla_sharding_spec(r1) == _XLAC._get_xla_sharding_spec(a)
    torch.testing.assert_close(r1.cpu(), a_cpu * 2)
    torch.testing.assert_close(r2.cpu(), a_cpu.sum(0))


def test_post_optimization_hlo_shows_the_partitioners_all_reduce():
    t1_cpu, t2_cpu = torch.randn(1, 128), torch.randn(128, 1)
    t1, t2 = t1_cpu.to("xla"), t2_cpu.to("xla")
    xs.mark_sharding(t1, xs.Mesh(np.arange(N), (1, N)), (0, 1))
    t3 = t1 @ t2
    before = _XLAC._get_xla_tensors_hlo([t3])
    with env_vars.overlay({"XLA_DUMP_POST_OPTIMIZATIONS": "1"}):
        after = _XLAC._get_xla_tensors_hlo([t3])
    assert "all-reduce" not in before and "all-reduce(" in after
    assert "sharding={devices=[1,%d]%s}" % (N, ",".join(map(str, range(N)))) in after
    torch.testing.assert_close(t3.cpu(), t1_cpu @ t2_cpu)
