"""Stored checkpoints are data: a pickle in them that would run code is refused, never run;
and CheckpointManager's checkpoints survive a SIGKILL at any moment of a save."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.api import CheckpointException

from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as FSDP
from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
from torch_xla.experimental.distributed_checkpoint import CheckpointManager, SPMDLoadPlanner, SPMDSavePlanner
from torch_xla.experimental.distributed_checkpoint import manager as manager_module

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import checkpoint_kill_workers as kw  # noqa: E402
from mp_scripts import checkpoint_workers as cw  # noqa: E402
from mp_scripts import fsdp_workers as fw  # noqa: E402


class _Payload:
    """Pickles as a call of os.mkdir(marker): unpickling it creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _refused(err: BaseException) -> bool:
    return "Weights only load failed" in str(err) and "mkdir" in str(err)


# ---- torch.distributed.checkpoint with the xla planners ---------------------------------------

def test_planner_refuses_a_stored_callable(tmp_path):
    marker = tmp_path / "ran"
    w = torch.arange(6.0).reshape(2, 3)
    dist_cp.save({"w": w.to("xla"), "item": _Payload(marker)}, storage_writer=dist_cp.FileSystemWriter(tmp_path / "c"),
                 planner=SPMDSavePlanner())
    assert not marker.exists()
    target = {"w": torch.zeros(2, 3, device="xla"), "item": None}
    with pytest.raises(CheckpointException) as e:
        dist_cp.load(target, storage_reader=dist_cp.FileSystemReader(tmp_path / "c"), planner=SPMDLoadPlanner())
    assert any(_refused(f) for f in e.value.failures.values()), e.value.failures
    assert not marker.exists() and target["item"] is None
    # the stored item does run code when read the way PyTorch's default planner reads it
    dist_cp.load({"w": torch.zeros(2, 3), "item": None}, storage_reader=dist_cp.FileSystemReader(tmp_path / "c"),
                 planner=dist_cp.DefaultLoadPlanner())
    assert marker.exists()


def test_planner_still_reads_plain_items(tmp_path):
    w = torch.arange(6.0).reshape(2, 3)
    item = {"step": 7, "lr": 0.5, "name": "x", "betas": (0.9, 0.99), "none": None, "size": torch.Size([2, 3]),
            "dtype": torch.bfloat16, "list": [1, "a", torch.tensor([1, 2])]}
    dist_cp.save({"w": w.to("xla"), "item": item}, storage_writer=dist_cp.FileSystemWriter(tmp_path),
                 planner=SPMDSavePlanner())
    placeholder = {k: None for k in item}
    placeholder["list"] = [0, "", torch.zeros(2, dtype=torch.int64)]
    target = {"w": torch.zeros(2, 3, device="xla"), "item": placeholder}
    dist_cp.load(target, storage_reader=dist_cp.FileSystemReader(tmp_path), planner=SPMDLoadPlanner())
    assert torch.equal(target["w"].cpu(), w)
    got = target["item"]
    assert {k: v for k, v in got.items() if k != "list"} == {k: v for k, v in item.items() if k != "list"}
    assert got["list"][:2] == [1, "a"] and torch.equal(got["list"][2], torch.tensor([1, 2]))


def test_manager_restore_refuses_a_stored_callable(tmp_path):
    marker = tmp_path / "ran"
    mgr = CheckpointManager(str(tmp_path / "ckpt"), save_interval=1, chkpt_on_preemption=False)
    assert mgr.save(3, {"w": torch.ones(2, device="xla"), "item": _Payload(marker)})
    with pytest.raises(CheckpointException) as e:
        mgr.restore(3, {"w": torch.zeros(2, device="xla"), "item": None})
    assert any(_refused(f) for f in e.value.failures.values()), e.value.failures
    assert not marker.exists()


# ---- consolidate_sharded_model_checkpoints ----------------------------------------------------

def _fsdp_checkpoint(path):
    cpu = fw.net()
    w = FSDP(fw.net().to("xla"))
    torch.save({"model": {k: v.cpu() for k, v in w.state_dict().items()}, "shard_metadata": w.get_shard_metadata()},
               path)
    return cpu


def test_consolidate_reads_shards_without_running_code(tmp_path):
    cpu = _fsdp_checkpoint(tmp_path / "ck_rank-0-of-1.pth")
    full, saved = consolidate_sharded_model_checkpoints(str(tmp_path / "ck"), "_rank-*-of-*.pth")
    torch.testing.assert_close(full, cpu.state_dict())
    torch.testing.assert_close(torch.load(saved)["model"], cpu.state_dict())


def test_consolidate_refuses_a_stored_callable(tmp_path):
    marker = tmp_path / "ran"
    _fsdp_checkpoint(tmp_path / "ck_rank-0-of-1.pth")
    ck = torch.load(tmp_path / "ck_rank-0-of-1.pth")
    ck["shard_metadata"]["extra"] = _Payload(marker)
    torch.save(ck, tmp_path / "ck_rank-0-of-1.pth")
    with pytest.raises(Exception) as e:   # torch.load's UnpicklingError
        consolidate_sharded_model_checkpoints(str(tmp_path / "ck"), "_rank-*-of-*.pth")
    assert _refused(e.value), e.value
    assert not marker.exists() and not (tmp_path / "ck_consolidated.pth").exists()


# ---- CheckpointManager: complete checkpoints only --------------------------------------------

def _save_steps(path, steps, **kw):
    mgr = CheckpointManager(str(path), save_interval=1, chkpt_on_preemption=False, **kw)
    for s in steps:
        assert mgr.save(s, kw_state(s))
    return mgr


def kw_state(step):
    return kw.state_dict(step, "xla")


def test_manager_lists_complete_steps_only(tmp_path):
    _save_steps(tmp_path, [1, 2, 3, 4])
    marker = json.loads((tmp_path / "2" / ".manager_metadata").read_text())
    assert marker["step"] == 2 and ".metadata" in marker["files"]
    # a data file lost (a deletion cut short, a partial copy), one cut short, a marker naming
    # another step, an interrupted deletion renamed aside
    data = [f for f in marker["files"] if f != ".metadata"]
    (tmp_path / "2" / data[0]).unlink()
    with open(tmp_path / "3" / data[0], "r+b") as f:
        f.truncate(5)
    os.rename(tmp_path / "1", tmp_path / "7")
    os.rename(tmp_path / "4", tmp_path / f"{manager_module._DEL_PREFIX}4-0")
    mgr = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    assert mgr.all_steps() == []
    assert not (tmp_path / f"{manager_module._DEL_PREFIX}4-0").exists()
    with pytest.raises(ValueError, match="untracked step 2"):
        mgr.restore(2, kw.empty_state_dict("xla"))
    # a tracked step whose files go missing later is refused at restore
    mgr.save(5, kw_state(5))
    (tmp_path / "5" / ".metadata").unlink()
    with pytest.raises(ValueError, match="step 5 is no longer complete"):
        mgr.restore(5, kw.empty_state_dict("xla"))


def _left_by(tmp_path, name, owner):
    d = tmp_path / name
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"partial")
    if owner is not None:
        (d / manager_module._OWNER_FILE).write_text(json.dumps(owner))
    return d


def test_manager_removes_saves_of_dead_processes_only(tmp_path):
    import socket
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    me = manager_module._owner()
    host = socket.gethostname()
    dead = _left_by(tmp_path, ".tmp-3-dead", {"host": host, "pid": dead_pid, "start": me["start"]})
    # this pid, but another process than the one that wrote it (the pid was taken again)
    reused = _left_by(tmp_path, ".tmp-3-reused", {"host": host, "pid": os.getpid(), "start": "1"})
    running = _left_by(tmp_path, ".tmp-4-running", me)
    elsewhere = _left_by(tmp_path, ".tmp-5-elsewhere", {"host": host + "-other", "pid": dead_pid, "start": None})
    unknown = _left_by(tmp_path, ".tmp-6-unknown", None)
    mgr = CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False)
    assert not dead.exists() and not reused.exists()
    assert running.exists() and elsewhere.exists() and unknown.exists()
    # a save of this manager records its owner while it runs, and keeps it with the checkpoint
    mgr.save(1, kw_state(1))
    assert json.loads((tmp_path / "1" / manager_module._OWNER_FILE).read_text()) == me


def test_manager_deletes_old_steps_and_resaves(tmp_path):
    mgr = _save_steps(tmp_path, [0, 1, 2, 3], max_to_keep=2)
    assert mgr.all_steps() == [2, 3]
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    mgr.save(2, kw_state(7))   # the same step again: replaced whole
    sd = kw.empty_state_dict("xla")
    CheckpointManager(str(tmp_path), save_interval=1, chkpt_on_preemption=False).restore(2, sd)
    assert kw.mismatch(sd, 7) == ""


@pytest.mark.slow
def test_manager_in_a_two_process_job(tmp_path):
    from torch_xla._engine import launcher
    res = launcher.spawn(cw.manager_save_restore, args=(str(tmp_path),), nprocs=2, return_results=True)
    for r in range(2):
        steps, w, meta, listing = res[r]
        assert steps == [4] and meta == {"step": 4} and listing == ["4"]
        torch.testing.assert_close(w, torch.full((4,), 4.5))


# ---- CheckpointManager under SIGKILL -----------------------------------------------------------

def _kill_run(tmp_path, tries, seed):
    """Runs the kill script; checks every restart and the final directory against what was saved."""
    base, log = tmp_path / "ckpt", tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env["PJRT_DEVICE"] = "CPU"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "mp_scripts", "checkpoint_kill_workers.py"),
                           str(base), str(tries), str(seed), str(log)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["statuses"] == [-9] * tries
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert not [r for r in records if "error" in r], [r["error"] for r in records if "error" in r]
    last = None   # the last step whose save returned
    for attempt in range(tries):
        mine = [r for r in records if r["try"] == attempt]
        start = next(r for r in mine if "seen" in r)
        seen = start["seen"]
        assert seen == sorted(seen) and all(s <= (-1 if last is None else last) + 1 for s in seen), (seen, last)
        # the newest listed step is the last save that returned, or the next one, killed
        # between its rename and its report
        newest = max(seen) if seen else None
        assert newest == last or newest == (0 if last is None else last + 1), (seen, last)
        if seen:
            assert start["mismatch"] == "", start
        saved = [r["saved"] for r in mine if "saved" in r]
        first = 0 if newest is None else newest + 1
        assert saved == list(range(first, first + len(saved)))
        last = saved[-1] if saved else newest
    assert last is not None and last >= tries, "the saves made no progress between the kills"
    # here, every step the manager lists restores to what was saved
    mgr = CheckpointManager(str(base), save_interval=1, chkpt_on_preemption=False)
    # and the saves that were killed (every child is gone) left nothing it could tell apart
    leftovers = [n for n in os.listdir(base) if n.startswith(".")]
    assert all(n.startswith(".tmp-") and not manager_module._abandoned(manager_module.url_to_fs(str(base))[0],
                                                                          str(base / n)) for n in leftovers), leftovers
    steps = mgr.all_steps()
    assert steps and max(steps) in (last, last + 1), (steps, last)
    for s in steps:
        sd = kw.empty_state_dict("xla")
        mgr.restore(s, sd)
        want = kw.state_dict(s, "cpu")
        torch.testing.assert_close(sd["w"].cpu(), want["w"])
        torch.testing.assert_close(sd["c"], want["c"])
        assert sd["meta"] == want["meta"]


def test_manager_survives_sigkill(tmp_path):
    _kill_run(tmp_path, tries=3, seed=1)


@pytest.mark.slow
def test_manager_survives_sigkill_20_times(tmp_path):
    _kill_run(tmp_path, tries=20, seed=0)
