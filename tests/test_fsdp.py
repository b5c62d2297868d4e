"""FSDP (XlaFullyShardedDataParallel), ZeRO-1 and list-form collectives on 2 processes.

Every replica trains on its slice of the global batch; the CPU trains the same model on
the whole batch (the gradients FSDP averages over replicas are the whole batch's). Losses,
gradient norms and the parameters consolidated from the sharded checkpoints must match,
and each replica must hold ceil(numel / 2) elements of every wrapped parameter."""
import copy
import functools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc

from torch_xla._engine import launcher
from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts
from torch_xla.distributed.fsdp.wrap import (recursive_wrap, size_based_auto_wrap_policy,
                                             transformer_auto_wrap_policy)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import fsdp_workers as fw  # noqa: E402

REPO = os.path.dirname(HERE)


def _cpu_train(ckpt_modules=(), optim=None, clip=None, n=2):
    m = fw.net()
    for name in ckpt_modules:  # the same reentrant checkpointing on the CPU
        sub = m.get_submodule(name)
        sub.forward = functools.partial(tc.checkpoint, sub.forward, use_reentrant=True)
    opt = (optim or (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)))(m.parameters())
    losses, norms = [], []
    for step in range(fw.STEPS):
        x, y = fw.batch(step, n)
        opt.zero_grad()
        loss = F.nll_loss(m(x), y)
        loss.backward()
        if clip is not None:
            norms.append(clip(m.parameters()))
        opt.step()
        losses.append(loss.detach())
    return m, losses, norms


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    res = launcher.spawn(fw.fsdp_job, args=(str(d),), nprocs=2, return_results=True)
    return sorted(res.values() if isinstance(res, dict) else res, key=lambda o: o["rank"]), d


@pytest.mark.slow
@pytest.mark.parametrize("name", list(fw.CONFIGS))
def test_fsdp_matches_cpu_training_on_the_global_batch(job, name):
    res, _ = job
    ckpt = {"nested_ckpt_reshard": ("conv1", "fc1"), "auto_wrap": ("fc1",)}.get(name, ())
    ref, losses, norms = _cpu_train(ckpt, clip=lambda p: torch.nn.utils.clip_grad_norm_(p, 0.5))
    for o in res:
        torch.testing.assert_close(o[name]["losses"], losses, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o[name]["norms"], norms, rtol=1e-5, atol=1e-6)
    full = consolidate_sharded_state_dicts([o[name]["state_dict"] for o in res], [o[name]["meta"] for o in res])
    torch.testing.assert_close(full, ref.state_dict(), rtol=1e-5, atol=1e-6)
    # Each replica holds 1/2 of every wrapped parameter (rounded up, padding included).
    total = sum(p.numel() for p in ref.parameters())
    for o in res:
        held = sum(k for _, k in o[name]["shards"])
        assert held < total / 2 + len(o[name]["shards"]) * 3
        if name != "flatten" and name != "dim0_no_reshard":
            sizes = sorted(k for _, k in o[name]["shards"])
            assert sizes == sorted(math.ceil(p.numel() / 2) for p in ref.parameters())


@pytest.mark.slow
def test_no_sync_accumulates_micro_batches(job):
    res, _ = job
    n, half = len(res), fw.BATCH // 2
    m = fw.net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    for step in range(fw.STEPS):
        x, y = fw.batch(step, n)
        opt.zero_grad()
        for j in (0, 1):  # micro-batch j of every replica, as one batch
            idx = torch.cat([torch.arange(r * fw.BATCH + j * half, r * fw.BATCH + (j + 1) * half) for r in range(n)])
            F.nll_loss(m(x[idx]), y[idx]).backward()
        opt.step()
    full = consolidate_sharded_state_dicts([o["no_sync"]["state_dict"] for o in res],
                                           [o["no_sync"]["meta"] for o in res])
    torch.testing.assert_close(full, m.state_dict(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_consolidate_command_line(job):
    _, d = job
    subprocess.run([sys.executable, "-m", "torch_xla.distributed.fsdp.consolidate_sharded_ckpts",
                    "--ckpt_prefix", str(d / "ckpt"), "--ckpt_suffix", "_rank-*-of-*.pth"],
                   check=True, cwd=REPO, capture_output=True, timeout=120)
    full = torch.load(d / "ckpt_consolidated.pth")["model"]
    ref, _, _ = _cpu_train(("conv1", "fc1"), clip=lambda p: torch.nn.utils.clip_grad_norm_(p, 0.5))
    torch.testing.assert_close(full, ref.state_dict(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_consolidate_with_stale_checkpoints_of_another_job(job, tmp_path):
    import shutil
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
    _, d = job
    for p in d.glob("ckpt_rank-*-of-*.pth"):
        shutil.copy(p, tmp_path / p.name)
    # A stale file of an earlier one-process job matching the same pattern, older than the
    # two-process set.
    stale = torch.load(next(iter(sorted(d.glob("ckpt_rank-*-of-*.pth")))), weights_only=False)
    stale["shard_metadata"] = dict(stale["shard_metadata"], world_size=1, rank=0)
    old = tmp_path / "ckpt_rank-00000000-of-00000001.pth"
    torch.save(stale, old)
    os.utime(old, (1, 1))
    # Without a complete set newer than every other file, which one is meant cannot be told.
    rank1 = tmp_path / "ckpt_rank-00000001-of-00000002.pth"
    rank1.rename(tmp_path / "aside")
    with pytest.raises(ValueError, match=r"different jobs \(world size 1: .*; world size 2: "):
        consolidate_sharded_model_checkpoints(str(tmp_path / "ckpt"), "_rank-*-of-*.pth")
    assert not (tmp_path / "ckpt_consolidated.pth").exists()
    # With it: that set is consolidated, and the stale file named in a warning.
    (tmp_path / "aside").rename(rank1)
    with pytest.warns(UserWarning, match="consolidating the newest complete set"):
        full, path = consolidate_sharded_model_checkpoints(str(tmp_path / "ckpt"), "_rank-*-of-*.pth")
    ref, _, _ = _cpu_train(("conv1", "fc1"), clip=lambda p: torch.nn.utils.clip_grad_norm_(p, 0.5))
    torch.testing.assert_close(full, ref.state_dict(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.load(path)["model"], full)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_zero1_matches_cpu_adam_with_clipping(job):
    res, _ = job
    ref, _, _ = _cpu_train(optim=lambda p: torch.optim.Adam(p, lr=0.01),
                           clip=lambda p: torch.nn.utils.clip_grad_norm_(p, 0.5))
    for o in res:
        torch.testing.assert_close(o["zero1"]["params"], ref.state_dict(), rtol=1e-4, atol=1e-6)
        assert o["zero1"]["shard_numels"] == [math.ceil(p.shape[0] / 2) * p[0].numel() for p in ref.parameters()]


@pytest.mark.slow
def test_list_collectives(job):
    res, _ = job
    a = [torch.arange(6.0).reshape(2, 3) + 10 * r for r in range(2)]
    b = [torch.arange(4.0) * (r + 1) for r in range(2)]
    want = [torch.cat(a), torch.cat(b)]
    for o in res:
        c = o["collectives"]
        for key in ("gathered", "bucketed", "out"):
            torch.testing.assert_close(c[key], want)
        r = o["rank"]
        total = [sum(x.repeat(2, 1) for x in a), sum(x.repeat(2) for x in b)]
        torch.testing.assert_close(c["rs"], [total[0][2 * r:2 * r + 2], total[1][4 * r:4 * r + 4]])
        torch.testing.assert_close(c["rs_out"], [total[0][2 * r:2 * r + 2]])


def test_wrap_policies_are_generic():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(self.a(x))

    class Wrapper(nn.Module):
        def __init__(self, m, **kw):
            super().__init__()
            self.inner, self.kw = m, kw

    model = nn.Sequential(Block(), nn.Linear(2, 2), Block())
    m, n = recursive_wrap(copy.deepcopy(model), functools.partial(transformer_auto_wrap_policy,
                          transformer_layer_cls={Block}), Wrapper, set(), set(), only_wrap_children=True, tag=1)
    assert [type(c).__name__ for c in m] == ["Wrapper", "Linear", "Wrapper"] and m[0].kw == {"tag": 1}
    assert n == 2 * sum(p.numel() for p in model[0].parameters())
    m, _ = recursive_wrap(copy.deepcopy(model), functools.partial(size_based_auto_wrap_policy, min_num_params=50),
                          Wrapper, set(), set(), only_wrap_children=True)
    # Bottom-up: each Block's `a` (72 parameters) is wrapped, leaving 18 in the Block.
    assert [type(c).__name__ for c in m] == ["Block", "Linear", "Block"]
    assert type(m[0].a).__name__ == "Wrapper" and isinstance(m[0].b, nn.Linear)


def test_compute_dtype_one_process():
    """bfloat16 compute with float32 shards: the CPU computes with a bfloat16 copy of the
    weights and applies its gradients to the float32 weights."""
    import torch_xla
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
    ref = fw.net()
    m = FSDP(fw.net(), compute_dtype=torch.bfloat16, fp32_reduce_scatter=True)
    assert isinstance(m.fc1, nn.Linear) and m.module is m._fsdp_wrapped_module  # attributes of the wrapped module
    with pytest.raises(RuntimeError, match="already wrapped"):
        FSDP(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = fw.batch(step, 1)
        low = copy.deepcopy(ref).to(torch.bfloat16)
        rl = F.nll_loss(low(x.to(torch.bfloat16)).float(), y)
        rl.backward()
        for p, q in zip(ref.parameters(), low.parameters()):
            p.grad = q.grad.float()
        ropt.step()
        opt.zero_grad()
        loss = F.nll_loss(m(x.to("xla")).float(), y.to("xla"))
        loss.backward()
        opt.step()
        torch_xla.sync()
        assert loss.dtype == torch.float32 and all(p.dtype == torch.float32 for p in m.parameters())
        torch.testing.assert_close(loss.cpu(), rl.detach(), rtol=2e-2, atol=2e-2)
    full = consolidate_sharded_state_dicts([m.state_dict()], [m.get_shard_metadata()])
    assert full["gain"].dtype == torch.float32  # buffers come back in their own dtype
    torch.testing.assert_close(full, ref.state_dict(), rtol=2e-2, atol=2e-2)
