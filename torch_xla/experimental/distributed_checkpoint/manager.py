"""`CheckpointManager`: per-step checkpoints under one base path (any fsspec URL).

Each checkpoint lives in `<base>/<step>/`. It is written into a hidden temporary
directory first and renamed into place once complete (data, `.metadata` and the
manager's own `.manager_metadata`), so a failed or interrupted save never leaves a
checkpoint the manager would restore; directories without valid manager metadata are
ignored.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Deque, List, Optional, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

import torch_xla
import torch_xla.core.xla_model as xm

from . import _preemption
from ._helpers import _sharded_cpu_state_dict
from .planners import SPMDLoadPlanner, SPMDSavePlanner

_MANAGER_METADATA_FILE = ".manager_metadata"
_TMP_PREFIX = ".tmp-"


@dataclass
class _CheckpointMetadata:
    step: int
    ts: float  # creation time (seconds since the epoch)


class CheckpointManager:
    """Takes and restores checkpoints identified by their training step.

    >>> mgr = CheckpointManager('/ckpt', save_interval=100, max_to_keep=3)
    >>> if mgr.all_steps():
    ...     prime_optimizer(optim)
    ...     sd = {'model': model.state_dict(), 'optim': optim.state_dict()}
    ...     mgr.restore(max(mgr.all_steps()), sd)
    ...     optim.load_state_dict(sd['optim'])
    >>> for step, batch in enumerate(loader):
    ...     ...
    ...     mgr.save_async(step, {'model': model.state_dict(), 'optim': optim.state_dict()})

    `save_interval`: steps between checkpoints; `max_to_keep`: the number of checkpoints
    kept (the oldest by creation time are deleted; 0: all); `max_pending_async`: async
    checkpoints in flight before `save_async` blocks; `num_of_threads`: writer threads;
    `process_group`: the group that coordinates the save (default: a new group of all
    processes when torch.distributed is initialized, else this process alone);
    `chkpt_on_preemption`: also checkpoint at the step a SIGTERM was seen.
    """

    def __init__(self, path: Union[str, os.PathLike], save_interval: int, max_to_keep: Optional[int] = 0,
                 max_pending_async: Optional[int] = 1, num_of_threads: Optional[int] = 1,
                 process_group: Optional[dist.ProcessGroup] = None, chkpt_on_preemption: bool = True) -> None:
        if save_interval <= 0:
            raise ValueError("save_interval must be positive")
        if max_pending_async <= 0:
            raise ValueError("max_pending_async must be positive")
        if max_to_keep < 0:
            raise ValueError("max_to_keep must be non-negative")
        self.base_path = os.path.join(os.fspath(path), "")
        self.save_interval = save_interval
        self.max_to_keep = max_to_keep
        self.num_of_threads = num_of_threads
        self.chkpt_on_preemption = chkpt_on_preemption
        self._distributed = dist.is_available() and dist.is_initialized()
        self.pg = (process_group or dist.new_group()) if self._distributed else None
        self._async_worker_pool = ThreadPoolExecutor(max_workers=1)
        self._async_sem = threading.Semaphore(max_pending_async)
        self._async_futures: List[Future] = []
        self._save_mutex = threading.Lock()
        self._tracked_chkpts: Deque[_CheckpointMetadata] = self._load_tracked_chkpts()
        if chkpt_on_preemption:
            _preemption.activate()

    # ---- storage ------------------------------------------------------------------------

    def _is_primary(self) -> bool:
        return not self._distributed or dist.get_rank(self.pg) == 0

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self.pg)

    def _get_path(self, step: int) -> str:
        return os.path.join(self.base_path, str(step))

    def _load_tracked_chkpts(self) -> Deque[_CheckpointMetadata]:
        fs, root = url_to_fs(self.base_path)
        found, invalid = [], []
        if not fs.exists(root):
            fs.makedirs(root, exist_ok=True)
        else:
            for entry in fs.ls(root, detail=False):
                name = os.path.basename(entry.rstrip("/"))
                if name.startswith("."):
                    continue
                try:
                    if not fs.exists(os.path.join(entry, ".metadata")):
                        raise FileNotFoundError(os.path.join(entry, ".metadata"))
                    with fs.open(os.path.join(entry, _MANAGER_METADATA_FILE), "r") as f:
                        md = json.load(f)
                    found.append(_CheckpointMetadata(step=int(md["step"]), ts=float(md["ts"])))
                except Exception:  # noqa: BLE001 - an unreadable directory is no checkpoint
                    invalid.append(entry)
        if invalid:
            logging.warning(f"Ignoring invalid checkpoints: {invalid}")
        return deque(sorted(found, key=lambda m: m.ts))

    def _delete_chkpt_at_step(self, step: int) -> None:
        if self._is_primary():
            fs, raw = url_to_fs(self._get_path(step))
            if fs.exists(raw):
                fs.rm(raw, recursive=True)

    def _release_oldest_checkpoints(self) -> None:
        if self.max_to_keep > 0:
            while len(self._tracked_chkpts) > self.max_to_keep:
                self._delete_chkpt_at_step(self._tracked_chkpts.popleft().step)

    def _wait_for_data(self) -> None:
        torch_xla.sync()
        xm.wait_device_ops()

    def _tmp_path(self, step: int) -> str:
        token = [uuid.uuid4().hex[:12] if self._is_primary() else None]
        if self._distributed:
            dist.broadcast_object_list(token, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return os.path.join(self.base_path, f"{_TMP_PREFIX}{step}-{token[0]}")

    def _save(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """Writes the checkpoint of `step` (the data must be ready: see `_wait_for_data`)."""
        with self._save_mutex:
            tmp = self._tmp_path(step)
            fs, raw_tmp = url_to_fs(tmp)
            try:
                dist_cp.save(state_dict=state_dict,
                             storage_writer=FsspecWriter(tmp, thread_count=self.num_of_threads),
                             planner=SPMDSavePlanner(), process_group=self.pg,
                             no_dist=not self._distributed)
                metadata = _CheckpointMetadata(step=step, ts=time.time())
                self._barrier()
                if self._is_primary():
                    with fs.open(os.path.join(raw_tmp, _MANAGER_METADATA_FILE), "w") as f:
                        json.dump({"step": metadata.step, "ts": metadata.ts}, f)
                    self._delete_chkpt_at_step(step)
                    _, raw_final = url_to_fs(self._get_path(step))
                    fs.mv(raw_tmp, raw_final, recursive=True)
            except BaseException:
                if self._is_primary() and fs.exists(raw_tmp):
                    fs.rm(raw_tmp, recursive=True)
                raise
            self._barrier()
            self._tracked_chkpts = deque(m for m in self._tracked_chkpts if m.step != step)
            self._tracked_chkpts.append(metadata)
            self._release_oldest_checkpoints()

    # ---- API ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `step` is a checkpoint step: a multiple of `save_interval`, or the step
        at which a preemption was detected."""
        preempted = False
        if self.chkpt_on_preemption and self.reached_preemption(step):
            logging.warning(f"Preemption sync point reached at step {step}. Triggering a checkpoint.")
            preempted = True
        return step % self.save_interval == 0 or preempted

    def save(self, step: int, state_dict: STATE_DICT_TYPE, force: Optional[bool] = False) -> bool:
        """Checkpoints `state_dict` now if `should_save(step)` or `force`; True if it did."""
        if self.should_save(step) or force:
            self._wait_for_data()
            self._save(step, state_dict)
            return True
        return False

    def save_async(self, step: int, state_dict: STATE_DICT_TYPE, force: Optional[bool] = False) -> bool:
        """Like `save`, but only the copy to the CPU happens now; the write runs in the
        background (blocks while `max_pending_async` checkpoints are in flight)."""
        if self.should_save(step) or force:
            self._wait_for_data()
            cpu_state_dict = _sharded_cpu_state_dict(state_dict)
            self._async_sem.acquire()
            future = self._async_worker_pool.submit(self._save, step, cpu_state_dict)
            future.add_done_callback(self._async_done)
            self._async_futures.append(future)
            return True
        return False

    def _async_done(self, future: Future) -> None:
        self._async_sem.release()
        if future.exception() is not None:
            logging.error(f"async checkpoint failed: {future.exception()!r}")

    def restore(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """Loads the checkpoint of `step` in place into `state_dict` (sharded xla tensors
        keep their layout; call `load_state_dict` for non-tensor values)."""
        tracked = {m.step for m in self._tracked_chkpts}
        if step not in tracked:
            raise ValueError(f"Cannot restore from untracked step {step}. Valid steps are: {sorted(tracked)}")
        dist_cp.load(state_dict=state_dict, storage_reader=FsspecReader(self._get_path(step)),
                     planner=SPMDLoadPlanner(), process_group=self.pg, no_dist=not self._distributed)

    def load(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """Same as `restore`."""
        self.restore(step, state_dict)

    def all_steps(self) -> List[int]:
        """The steps of all tracked checkpoints, ascending."""
        return sorted(m.step for m in self._tracked_chkpts)

    def join(self) -> None:
        """Waits for pending async checkpoints; raises if one of them failed."""
        futures, self._async_futures = self._async_futures, []
        wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise RuntimeError(f"{len(errors)} async checkpoint(s) failed") from errors[0]

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was detected and `step` is the agreed checkpoint step."""
        if not self.chkpt_on_preemption:
            raise RuntimeError("Preemption detection not enabled: create the CheckpointManager "
                               "with chkpt_on_preemption=True")
        return _preemption.sync_point_reached(step, self.pg)

