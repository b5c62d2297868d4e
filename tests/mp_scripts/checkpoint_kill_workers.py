"""CheckpointManager saves killed with SIGKILL at random moments (tests/test_checkpoint_safety.py).

Run as a script: `checkpoint_kill_workers.py BASE TRIES SEED LOG`. The process imports
torch_xla once, then for each try forks a child (which starts its own runtime) that opens
a manager over BASE, restores the newest step it lists and checks it, then saves step after
step until it is killed, a random time after its restore (seeded). Every event is one JSON
line appended to LOG with a single write, so a kill never leaves half a line.
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time
import traceback

import torch

MAX_TO_KEEP = 3


def state_dict(step: int, device) -> dict:
    """What step `step` saves (a function of the step alone, so that any reader can check it)."""
    return {"w": torch.full((4, 3), step + 0.5, device=device),
            "c": torch.arange(5, dtype=torch.int64) + step,
            "meta": {"step": step, "name": f"s{step}", "sizes": [step, step + 1]}}


def empty_state_dict(device) -> dict:
    return {"w": torch.zeros(4, 3, device=device), "c": torch.zeros(5, dtype=torch.int64),
            "meta": {"step": -1, "name": "", "sizes": [0, 0]}}


def mismatch(restored: dict, step: int) -> str:
    """"" when `restored` holds what step `step` saved, else what differs."""
    want = state_dict(step, "cpu")
    got = {"w": restored["w"].cpu(), "c": restored["c"].cpu(), "meta": restored["meta"]}
    for k in ("w", "c"):
        if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]):
            return f"{k}: {got[k].tolist()} != {want[k].tolist()}"
    return "" if got["meta"] == want["meta"] else f"meta: {got['meta']} != {want['meta']}"


def _log(fd: int, **record) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())


def _child(base: str, attempt: int, log_fd: int, ready_fd: int) -> None:
    from torch_xla.experimental.distributed_checkpoint import CheckpointManager
    mgr = CheckpointManager(base, save_interval=1, max_to_keep=MAX_TO_KEEP, chkpt_on_preemption=False)
    seen = mgr.all_steps()
    record = {"try": attempt, "seen": seen}
    if seen:
        sd = empty_state_dict("xla")
        mgr.restore(max(seen), sd)
        record["mismatch"] = mismatch(sd, max(seen))
    _log(log_fd, **record)
    # the runtime is up and the step's program compiled: the kill falls among the saves
    for v in state_dict(0, "xla").values():
        if isinstance(v, torch.Tensor):
            v.cpu()
    os.write(ready_fd, b"r")
    _log(log_fd, **{"try": attempt, "ready": time.monotonic()})
    step = max(seen) + 1 if seen else 0
    while True:
        mgr.save(step, state_dict(step, "xla"))
        _log(log_fd, **{"try": attempt, "saved": step, "t": time.monotonic()})
        step += 1


def main(base: str, tries: str, seed: str, log_path: str) -> None:
    import torch_xla  # noqa: F401  (imported once, before the forks; the runtime starts in each child)
    import torch_xla.experimental.distributed_checkpoint  # noqa: F401
    rng = random.Random(int(seed))
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    statuses = []
    for attempt in range(int(tries)):
        delay = rng.uniform(0.0, 0.25)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            try:
                _child(base, attempt, log_fd, ready_w)
            except BaseException:
                _log(log_fd, **{"try": attempt, "error": traceback.format_exc()})
                os._exit(1)
            os._exit(0)
        os.close(ready_w)
        ok, _, _ = select.select([ready_r], [], [], 60)
        if ok and os.read(ready_r, 1):
            time.sleep(delay)
        os.close(ready_r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        statuses.append(os.waitstatus_to_exitcode(status))
    print(json.dumps({"statuses": statuses}))


if __name__ == "__main__":
    main(*sys.argv[1:])
