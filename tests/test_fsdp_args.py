"""XlaFullyShardedDataParallel's arguments: every one either works or, when it cannot
change anything here, warns once per process; unknown keyword arguments are a TypeError
worded as PyTorch's modules word it.

Training is compared with the CPU: in one process (the collectives are the identity) on
the whole batch, and on 2 processes (tests/mp_scripts/fsdp_args_workers.py), where each
replica trains on its slice of the global batch the CPU trains on."""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla._engine import launcher
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP, consolidate_sharded_state_dicts
from torch_xla.distributed.fsdp import xla_fully_sharded_data_parallel as fsdp_module

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import fsdp_args_workers as aw  # noqa: E402
from mp_scripts import fsdp_workers as fw  # noqa: E402


@pytest.fixture
def fresh_warnings():
    fsdp_module._WARNED.clear()
    yield
    fsdp_module._WARNED.clear()


def _ours(record):
    return [str(w.message) for w in record if str(w.message).startswith("XlaFullyShardedDataParallel:")]


def _ir(tensors):
    return torch_xla._XLAC._get_xla_tensors_text(list(tensors))


def _cpu_train(n=1, steps=fw.STEPS):
    m = fw.net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    losses = []
    for step in range(steps):
        x, y = fw.batch(step, n)
        opt.zero_grad()
        loss = F.nll_loss(m(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        losses.append(loss.detach())
    return m, losses


def _nested(**kw):
    m = fw.net()
    m.conv1, m.fc1 = FSDP(m.conv1, **kw), FSDP(m.fc1, **kw)
    return FSDP(m, **kw)


# ---- unknown keyword arguments ---------------------------------------------------------------

@pytest.mark.parametrize("bad", ["bogus", "reshard_after_foward", "mark_step_on_finalization"])
def test_unknown_keyword_is_a_type_error_worded_as_pytorch(bad):
    with pytest.raises(TypeError) as theirs:
        nn.Linear(2, 2, **{bad: True})
    with pytest.raises(TypeError) as ours:
        FSDP(fw.net(), **{bad: True})
    # "<Class>.__init__() got an unexpected keyword argument '<bad>'"
    assert str(ours.value) == str(theirs.value).replace("Linear.", "XlaFullyShardedDataParallel.")
    assert str(ours.value).endswith(f"__init__() got an unexpected keyword argument '{bad}'")


def test_auto_wrap_forwards_every_argument(fresh_warnings):
    kw = dict(coalesce_all_gather_ops=True, reduce_scatter_bucket_size_mb=1, sync_on_finalization=True,
              execute_sharding_on_init=False, _shard_size_multiple=4, _use_xla_patched_linear=False)
    m = FSDP(fw.net(), auto_wrap_policy=lambda module, recurse, unwrapped_params: recurse or unwrapped_params > 40,
             **kw)
    inner = [w for w in m.modules() if isinstance(w, FSDP) and w is not m]
    assert len(inner) == 1 and m.module.fc1 is inner[0]
    for w in (m, inner[0]):
        assert w.coalesce_all_gather_ops and w.sync_on_finalization and w._shard_size_multiple == 4
        assert w._bucket_bytes == 1024 * 1024
    assert "forward" not in inner[0].module.__dict__ and "forward" not in m.module.fc2.__dict__  # not patched
    assert all(p.numel() % 4 == 0 for p in m.parameters())


# ---- arguments that change nothing: one warning per argument per process --------------------

def test_defaults_warn_nothing(fresh_warnings):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _nested()
    assert _ours(rec) == []


def test_no_effect_arguments_warn_once(fresh_warnings):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _nested(pin_layout_in_collective_ops=False, _debug_print=True, _debug_msg="mine")
        FSDP(fw.net(), pin_layout_in_collective_ops=False, _debug_dummy_all_gather_op=True)
    msgs = _ours(rec)
    assert len(msgs) == 4, msgs
    assert sum("pin_layout_in_collective_ops=False has no effect here" in m for m in msgs) == 1
    for arg in ("_debug_print=True", "_debug_msg='mine'", "_debug_dummy_all_gather_op=True"):
        assert sum(f"{arg} has no effect here" in m for m in msgs) == 1


def test_invalid_values():
    with pytest.raises(ValueError, match="reduce_scatter_bucket_size_mb"):
        FSDP(fw.net(), reduce_scatter_bucket_size_mb=-1)
    with pytest.raises(ValueError, match="_shard_size_multiple"):
        FSDP(fw.net(), _shard_size_multiple=0)
    with pytest.raises(ValueError, match="sharding_rank=1"):
        FSDP(fw.net(), sharding_groups=[[0]], sharding_rank=1)
    with pytest.raises(ValueError, match="sharding_world_size=2"):
        FSDP(fw.net(), sharding_groups=[[0]], sharding_world_size=2)
    FSDP(fw.net(), sharding_groups=[[0]], sharding_rank=0, sharding_world_size=1)


# ---- arguments that work ---------------------------------------------------------------------

@pytest.mark.parametrize("execute", [True, False])
def test_execute_sharding_on_init(execute):
    cpu = fw.net()
    m = fw.net().to("xla")
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2)  # pending values to shard
    for p in cpu.parameters():
        p.data.mul_(2)
    w = FSDP(m, execute_sharding_on_init=execute)
    pending = ["device_data" not in _ir([p]).strip().splitlines()[-2] for p in w.parameters()]
    assert pending == [not execute] * len(pending)
    full = consolidate_sharded_state_dicts([w.state_dict()], [w.get_shard_metadata()])
    torch.testing.assert_close(full, cpu.state_dict())


@pytest.mark.parametrize("on", [True, False])
def test_sync_on_finalization(on):
    m = _nested(sync_on_finalization=on, reduce_scatter_bucket_size_mb=1e-4)
    x, y = fw.batch(0, 1)
    loss = F.nll_loss(m(x.to("xla")), y.to("xla"))
    before = met.counter_value("MarkStep") or 0
    loss.backward()
    assert (met.counter_value("MarkStep") or 0) - before == int(on)
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None for g in grads)
    assert all(("xla::reduce_scatter" not in _ir([g])) == on for g in grads)
    ref = fw.net()
    F.nll_loss(ref(x), y).backward()
    full = consolidate_sharded_state_dicts([{k: p.grad for k, p in m.named_parameters()}], [m.get_shard_metadata()])
    torch.testing.assert_close(full, {k: p.grad for k, p in ref.named_parameters()})


def test_coalesce_all_gather_ops_is_one_collective():
    x, y = fw.batch(0, 1)
    for coalesce, want in ((False, (0, 6)), (True, (1, 0))):
        m = FSDP(fw.net(), coalesce_all_gather_ops=coalesce)
        txt = _ir([m(x.to("xla"))])
        assert (txt.count("xla::all_gather_coalesced"), txt.count("xla::all_gather(")) == want
        torch_xla.sync()


@pytest.mark.parametrize("mb,collectives", [(0, 6), (1e-4, 3), (1, 1)])
def test_reduce_scatter_bucket_size_mb(mb, collectives):
    """Gradients arrive fc2.bias, fc2.weight, fc1.bias, fc1.weight, conv1.bias,
    conv1.weight (12, 120, 40, 4320, 12, 108 bytes); a bucket is reduced once it holds
    more than the size, the rest at the end of the backward."""
    m = FSDP(fw.net(), reduce_scatter_bucket_size_mb=mb)
    x, y = fw.batch(0, 1)
    F.nll_loss(m(x.to("xla")), y.to("xla")).backward()
    assert _ir([p.grad for p in m.parameters()]).count("xla::reduce_scatter") == collectives


def test_shard_size_multiple_pads_and_gathers_rows():
    m = FSDP(fw.net(), _shard_size_multiple=128)
    assert all(p.numel() % 128 == 0 for p in m.parameters())
    x, y = fw.batch(0, 1)
    assert "f32[1,128]" in _ir([m(x.to("xla"))])  # a shard of one row of 128 gathered
    torch_xla.sync()
    full = consolidate_sharded_state_dicts([m.state_dict()], [m.get_shard_metadata()])
    torch.testing.assert_close(full, fw.net().state_dict())
    dim0 = FSDP(fw.net(), _shard_size_multiple=128, shard_param_on_dim_0=True)  # as PyTorch/XLA: no padding
    assert sorted(p.numel() for p in dim0.parameters()) == sorted(p.numel() for p in fw.net().parameters())


def test_use_xla_patched_linear():
    assert "forward" in FSDP(fw.net()).module.fc1.__dict__
    assert "forward" not in FSDP(fw.net(), _use_xla_patched_linear=False).module.fc1.__dict__


@pytest.mark.parametrize("name", list(aw.CONFIGS))
def test_options_train_as_the_cpu_one_process(name):
    kw = aw.CONFIGS[name]
    ref, want = _cpu_train(steps=2)
    m = _nested(**kw)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    for step in range(2):
        x, y = fw.batch(step, 1)
        opt.zero_grad()
        loss = F.nll_loss(m(x.to("xla")), y.to("xla"))
        loss.backward()
        m.clip_grad_norm_(0.5)
        opt.step()
        torch_xla.sync()
        torch.testing.assert_close(loss.cpu(), want[step], rtol=1e-4, atol=1e-5)
    full = consolidate_sharded_state_dicts([m.state_dict()], [m.get_shard_metadata()])
    torch.testing.assert_close(full, ref.state_dict(), rtol=1e-4, atol=1e-5)


# ---- two processes ---------------------------------------------------------------------------

# about 18 s; tests/test_fsdp_scale.py's 2-process job covers FSDP across processes in the main suite
@pytest.mark.slow
def test_options_train_as_the_cpu_on_the_global_batch_2_processes():
    res = launcher.spawn(aw.fsdp_args_job, nprocs=2, return_results=True)
    res = sorted(res.values() if isinstance(res, dict) else res, key=lambda o: o["rank"])
    ref, losses = _cpu_train(n=2)
    for name, kw in aw.CONFIGS.items():
        for o in res:
            torch.testing.assert_close(o[name]["losses"], losses, rtol=1e-4, atol=1e-5)
        full = consolidate_sharded_state_dicts([o[name]["state_dict"] for o in res], [o[name]["meta"] for o in res])
        torch.testing.assert_close(full, ref.state_dict(), rtol=1e-4, atol=1e-5)
        if kw.get("_shard_size_multiple"):
            assert all(k % 128 == 0 for o in res for k in o[name]["shards"]), name


def test_zero_redundancy_optimizer_warns_once_for_arguments_without_effect():
    import warnings as _w
    import torch
    from torch_xla.distributed import zero_redundancy_optimizer as zro
    zro._WARNED.clear()
    p = torch.nn.Parameter(torch.zeros(4, device="xla"))
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        zro.ZeroRedundancyOptimizer([p], torch.optim.SGD, lr=0.1, pin_layout=False, use_grad_acc_hook=True,
                                    save_master_weights=True)
        zro.ZeroRedundancyOptimizer([p], torch.optim.SGD, lr=0.1, pin_layout=False, save_master_weights=True)
    texts = [str(w.message) for w in caught if "ZeroRedundancyOptimizer" in str(w.message)]
    assert len(texts) == 2, texts
    assert any("pin_layout=False" in t for t in texts) and any("use_grad_acc_hook=True" in t for t in texts)
