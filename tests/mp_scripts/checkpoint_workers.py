"""Replica functions of tests/test_checkpoint_safety.py (importable by spawned processes)."""
from __future__ import annotations

import os


def manager_save_restore(rank: int, base: str):
    """Two processes save through one CheckpointManager (a gloo group coordinates), then
    each restores the newest step."""
    import torch
    import torch.distributed as dist

    import torch_xla.distributed.xla_backend  # noqa: F401  (the xla:// rendezvous)
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager
    dist.init_process_group("xla", init_method="xla://")
    mgr = CheckpointManager(base, save_interval=1, max_to_keep=1, chkpt_on_preemption=False,
                            process_group=dist.new_group(backend="gloo"))
    for step in (3, 4):
        mgr.save(step, {"w": torch.full((4,), step + 0.5, device="xla"), "meta": {"step": step}})
    out = {"w": torch.zeros(4, device="xla"), "meta": {"step": -1}}
    mgr.restore(max(mgr.all_steps()), out)
    return mgr.all_steps(), out["w"].cpu(), out["meta"], sorted(os.listdir(base))
