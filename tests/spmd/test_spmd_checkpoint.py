"""Distributed checkpoints of sharded models (torch_xla.experimental.distributed_checkpoint),
checked against the eager CPU values they were made from."""
import copy
import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dist_cp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.experimental.distributed_checkpoint import (CheckpointManager, SPMDLoadPlanner, SPMDSavePlanner,
                                                           prime_optimizer)
from torch_xla.experimental.distributed_checkpoint import _preemption
from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards, _sharded_cpu_state_dict

xr.use_spmd()
N = xr.global_runtime_device_count()
spec_of = torch_xla._XLAC._get_xla_sharding_spec


def _mesh(shape):
    return xs.Mesh(np.arange(N), shape)


def _cpu_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _sharded(cpu_model, mesh_shape, spec0, spec1=(None, None)):
    """An xla copy of `cpu_model` with its weights sharded over a mesh of `mesh_shape`."""
    m = copy.deepcopy(cpu_model).to("xla")
    mesh = _mesh(mesh_shape)
    xs.mark_sharding(m[0].weight, mesh, spec0)
    xs.mark_sharding(m[2].weight, mesh, spec1)
    return m


def _writer(path):
    return dist_cp.FileSystemWriter(path)


def _save(sd, path, planner=None):
    dist_cp.save(sd, storage_writer=_writer(path), planner=planner or SPMDSavePlanner())


def _load(sd, path, planner=None):
    dist_cp.load(sd, storage_reader=dist_cp.FileSystemReader(path), planner=planner or SPMDLoadPlanner())


def _assert_model_equals(xla_model, cpu_model):
    for (name, p), (_, q) in zip(xla_model.state_dict().items(), cpu_model.state_dict().items()):
        assert torch.equal(p.cpu(), q), name


def _chunks(path, fqn):
    md = dist_cp.FileSystemReader(path).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[fqn].chunks)


@pytest.mark.parametrize("src, dst", [
    (((N, 1), (0, 1)), ((2, N // 2), (1, 0))),
    (((2, N // 2), (0, None)), ((N, 1), (None, 0))),
    (((2, N // 2), (0, 1)), ((N // 2, 2), (0, 1))),
])
def test_sharded_model_reshards_on_load(tmp_path, src, dst):
    ref = _cpu_model(0)
    model = _sharded(ref, *src)
    target = _sharded(_cpu_model(1), *dst)
    target_spec = spec_of(target[0].weight)
    _save(model.state_dict(), tmp_path)
    sd = target.state_dict()
    _load(sd, tmp_path)
    _assert_model_equals(target, ref)
    assert spec_of(target[0].weight) == target_spec  # the target keeps its layout
    x = torch.randn(4, 16)
    torch.testing.assert_close(target(x.to("xla")).cpu(), ref(x), rtol=1e-5, atol=1e-5)


def test_saved_pieces_are_the_replica0_shards(tmp_path):
    # (2, 2) mesh, dim 0 split in 2, replicated over mesh axis 1: 2 pieces, not 4.
    model = _sharded(_cpu_model(0), (2, N // 2), (0, None), (None, 1))
    _save(model.state_dict(), tmp_path)
    assert _chunks(tmp_path, "0.weight") == [((0, 0), (16, 16)), ((16, 0), (16, 16))]
    assert _chunks(tmp_path, "2.weight") == [((0, 0), (8, 16)), ((0, 16), (8, 16))]
    assert _chunks(tmp_path, "0.bias") == [((0,), (32,))]
    # A plain reader sees the whole values.
    cpu_sd = {k: torch.zeros_like(v) for k, v in _cpu_model(0).state_dict().items()}
    dist_cp.load(cpu_sd, storage_reader=dist_cp.FileSystemReader(tmp_path))
    for k, v in _cpu_model(0).state_dict().items():
        assert torch.equal(cpu_sd[k], v), k


def test_uneven_shards_round_trip(tmp_path):
    torch.manual_seed(2)
    ref = nn.Linear(13, 7)
    m1 = copy.deepcopy(ref).to("xla")
    m2 = nn.Linear(13, 7).to("xla")
    xs.mark_sharding(m1.weight, _mesh((N,)), (0, None))
    xs.mark_sharding(m2.weight, _mesh((N,)), (None, 0))
    # The annotated parameters themselves (a state_dict's detached copies lose an uneven
    # layout's annotation: see the report); 7 rows over 4 devices: pieces of 2, 2, 2, 1.
    _save({"weight": m1.weight, "bias": m1.bias}, tmp_path / "a")
    assert _chunks(tmp_path / "a", "weight") == [((0, 0), (2, 13)), ((2, 0), (2, 13)), ((4, 0), (2, 13)),
                                                 ((6, 0), (1, 13))]
    _load({"weight": m2.weight, "bias": m2.bias}, tmp_path / "a")
    assert torch.equal(m2.weight.cpu(), ref.weight.detach())
    assert torch.equal(m2.bias.cpu(), ref.bias.detach())
    assert spec_of(m2.weight) == "{devices=[1,4]0,1,2,3}"
    # Through state_dict(): the values round-trip all the same.
    _save(m1.state_dict(), tmp_path / "b")
    target = nn.Linear(13, 7).to("xla")
    xs.mark_sharding(target.weight, _mesh((N,)), (None, 0))
    _load(target.state_dict(), tmp_path / "b")
    assert torch.equal(target.weight.cpu(), ref.weight.detach())


def test_unsharded_and_cpu_values_round_trip(tmp_path):
    torch.manual_seed(3)
    a, b, c = torch.randn(5, 3), torch.randn(4), torch.arange(6, dtype=torch.int32)
    sd = {"xla": a.to("xla"), "cpu": b.clone(), "nested": {"list": [c.to("xla"), 3, "s"]}, "step": 7}
    rep = torch.randn(8, 4)
    sd["replicated"] = rep.to("xla")
    xs.mark_sharding(sd["replicated"], _mesh((N, 1)), (None, None))
    _save(sd, tmp_path)
    out = {"xla": torch.zeros(5, 3, device="xla"), "cpu": torch.zeros(4),
           "nested": {"list": [torch.zeros(6, dtype=torch.int32, device="xla"), 0, ""]}, "step": 0,
           "replicated": torch.zeros(8, 4, device="xla")}
    _load(out, tmp_path)
    assert torch.equal(out["xla"].cpu(), a)
    assert torch.equal(out["cpu"], b)
    assert torch.equal(out["nested"]["list"][0].cpu(), c)
    assert out["nested"]["list"][1:] == [3, "s"] and out["step"] == 7
    assert torch.equal(out["replicated"].cpu(), rep)


def test_interop_with_default_planners(tmp_path):
    ref = _cpu_model(0)
    # Saved by the default planner from an unsharded model, loaded into a sharded one.
    _save(copy.deepcopy(ref).to("xla").state_dict(), tmp_path / "a", planner=dist_cp.DefaultSavePlanner())
    target = _sharded(_cpu_model(1), (N, 1), (0, 1))
    _load(target.state_dict(), tmp_path / "a")
    _assert_model_equals(target, ref)
    # Saved sharded, loaded by the default planner into an unsharded xla model.
    _save(_sharded(ref, (2, N // 2), (0, 1)).state_dict(), tmp_path / "b")
    plain = _cpu_model(1).to("xla")
    _load(plain.state_dict(), tmp_path / "b", planner=dist_cp.DefaultLoadPlanner())
    _assert_model_equals(plain, ref)


def test_cpu_state_dict_for_async_saves(tmp_path):
    ref = _cpu_model(0)
    model = _sharded(ref, (N, 1), (0, 1))
    cpu_sd = _sharded_cpu_state_dict({"model": model.state_dict()})
    w = cpu_sd["model"]["0.weight"]
    assert isinstance(w, _CpuShards) and len(w.shards) == N
    for s in w.shards:
        assert torch.equal(s.data, ref[0].weight.detach()[tuple(s.indices)])
    assert cpu_sd["model"]["0.bias"].device.type == "cpu"
    _save(cpu_sd, tmp_path)
    target = _sharded(_cpu_model(1), (2, N // 2), (1, 0))
    _load({"model": target.state_dict()}, tmp_path)
    _assert_model_equals(target, ref)


def test_load_planner_rejects_mismatched_shapes(tmp_path):
    _save(_sharded(_cpu_model(0), (N, 1), (0, 1)).state_dict(), tmp_path)
    wrong = nn.Linear(16, 16).to("xla")
    xs.mark_sharding(wrong.weight, _mesh((N, 1)), (0, 1))
    with pytest.raises(CheckpointException) as e:
        _load({"0.weight": wrong.weight.detach()}, tmp_path)
    assert any("Size mismatch" in str(f) for f in e.value.failures.values())


# ---- CheckpointManager ---------------------------------------------------------------------

def _manager(path, **kw):
    kw.setdefault("chkpt_on_preemption", False)
    return CheckpointManager(str(path), save_interval=10, **kw)


def test_manager_keeps_last_n_and_restores_newest(tmp_path):
    mgr = _manager(tmp_path, max_to_keep=2, num_of_threads=2)  # two writer threads
    assert mgr.all_steps() == []
    refs = {}
    for step in range(0, 35):
        ref = _cpu_model(step)
        saved = mgr.save(step, _sharded(ref, (N, 1), (0, 1)).state_dict()) if step % 10 == 0 else mgr.save(
            step, {})
        assert saved == (step % 10 == 0)
        refs[step] = ref
    assert mgr.all_steps() == [20, 30]
    assert sorted(os.listdir(tmp_path)) == ["20", "30"]
    # The oldest by creation time goes first, not the lowest step.
    mgr.save(10, _sharded(refs[10], (N, 1), (0, 1)).state_dict())
    assert mgr.all_steps() == [10, 30]
    # A new manager over the same path sees the same checkpoints; restore the newest step.
    mgr = _manager(tmp_path, max_to_keep=2)
    assert mgr.all_steps() == [10, 30]
    target = _sharded(_cpu_model(99), (2, N // 2), (1, 0))
    mgr.restore(max(mgr.all_steps()), target.state_dict())
    _assert_model_equals(target, refs[30])
    with pytest.raises(ValueError, match="untracked step"):
        mgr.restore(20, target.state_dict())


def test_manager_ignores_partial_checkpoints(tmp_path, monkeypatch):
    ref = _cpu_model(0)
    mgr = _manager(tmp_path)
    assert mgr.save(10, _sharded(ref, (N, 1), (0, 1)).state_dict())
    # A save that dies while writing leaves nothing behind.
    calls = []
    original = SPMDSavePlanner.resolve_data

    def failing(self, item):
        calls.append(item)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(self, item)

    monkeypatch.setattr(SPMDSavePlanner, "resolve_data", failing)
    with pytest.raises(CheckpointException):
        mgr.save(20, _sharded(_cpu_model(1), (N, 1), (0, 1)).state_dict())
    monkeypatch.undo()
    assert len(calls) == 2
    assert mgr.all_steps() == [10]
    assert sorted(os.listdir(tmp_path)) == ["10"]
    # A directory without the manager's metadata (a crash before the rename) is ignored too.
    (tmp_path / "30").mkdir()
    (tmp_path / "30" / "__0_0.distcp").write_bytes(b"partial")
    mgr = _manager(tmp_path)
    assert mgr.all_steps() == [10]
    target = _sharded(_cpu_model(1), (N, 1), (0, 1))
    mgr.restore(10, target.state_dict())
    _assert_model_equals(target, ref)


def test_manager_async(tmp_path):
    mgr = _manager(tmp_path, max_pending_async=2)
    refs = {}
    model = _sharded(_cpu_model(0), (N, 1), (0, 1))
    for step in (0, 5, 10, 20):
        refs[step] = {k: v.cpu() for k, v in model.state_dict().items()}
        assert mgr.save_async(step, model.state_dict()) == (step % 10 == 0)
        with torch.no_grad():  # the model moves on while the checkpoint is written
            for p in model.parameters():
                p.add_(1.0)
        torch_xla.sync()
    mgr.join()
    assert mgr.all_steps() == [0, 10, 20]
    target = _sharded(_cpu_model(1), (2, N // 2), (0, 1))
    mgr.restore(10, target.state_dict())
    for k, v in target.state_dict().items():
        assert torch.equal(v.cpu(), refs[10][k]), k


def test_preemption_triggers_a_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path), save_interval=100)
    try:
        assert not mgr.should_save(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.should_save(4) and mgr.reached_preemption(4)
        assert not mgr.should_save(5)
    finally:
        _preemption.deactivate()
    assert not _preemption.is_active()


# ---- optimizer state ---------------------------------------------------------------------

def _train(model, optim, steps, seed):
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        optim.zero_grad()
        nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        optim.step()
        if dev.type == "xla":
            torch_xla.sync()


def test_optimizer_state_round_trip(tmp_path):
    ref = _cpu_model(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    model = _sharded(ref, (N, 1), (0, 1), (None, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(ref, ref_opt, 2, seed=1)
    _train(model, opt, 2, seed=1)
    mgr = _manager(tmp_path)
    assert mgr.save(0, {"model": model.state_dict(), "optim": opt.state_dict()})

    # Another layout (a 2-d mesh of 2x2 does not train yet: see the report).
    new = _sharded(_cpu_model(5), (1, N), (1, 0), (None, 1))
    new_opt = torch.optim.AdamW(new.parameters(), lr=0.5)
    prime_optimizer(new_opt)
    sd = {"model": new.state_dict(), "optim": new_opt.state_dict()}
    mgr.restore(0, sd)
    new.load_state_dict(sd["model"])
    new_opt.load_state_dict(sd["optim"])
    assert new_opt.param_groups[0]["lr"] == 0.01
    for i, p in enumerate(new.parameters()):
        st, ref_st = new_opt.state[p], ref_opt.state[list(ref.parameters())[i]]
        assert float(st["step"]) == float(ref_st["step"]) == 2.0
        torch.testing.assert_close(st["exp_avg"].cpu(), ref_st["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st["exp_avg_sq"].cpu(), ref_st["exp_avg_sq"], rtol=1e-5, atol=1e-7)
    # Training continues from the restored state as it does on the CPU.
    _train(ref, ref_opt, 1, seed=2)
    _train(new, new_opt, 1, seed=2)
    for p, q in zip(new.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-4, atol=1e-5)
    assert spec_of(new[0].weight) == spec_of(_sharded(_cpu_model(5), (1, N), (1, 0))[0].weight)


def test_default_filesystem_writer(tmp_path):
    ref = _cpu_model(0)
    dist_cp.save(_sharded(ref, (N, 1), (0, 1)).state_dict(), storage_writer=dist_cp.FileSystemWriter(tmp_path),
                 planner=SPMDSavePlanner())
    target = _sharded(_cpu_model(1), (N, 1), (0, 1))
    _load(target.state_dict(), tmp_path)
    _assert_model_equals(target, ref)
