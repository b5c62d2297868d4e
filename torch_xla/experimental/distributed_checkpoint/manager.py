"""`CheckpointManager`: per-step checkpoints under one base path (any fsspec URL).

Each checkpoint lives in `<base>/<step>/`. It is written into a hidden temporary
directory (`.tmp-<step>-<token>`) first: the data and `.metadata` (synced to disk by the
writer), then the manager's own `.manager_metadata`, last, naming the step and the size of
every file; then the directory is renamed into place. A checkpoint is complete when its
`.manager_metadata` names its step and each file it lists is there with its size; the
manager lists and restores complete checkpoints only, so a save killed at any point leaves
the previous checkpoints as they were and none that would be restored half-written. A
checkpoint is deleted by renaming it aside (`.del-...`) first, for the same reason.
On a local disk the marker and the directories are synced too, so that a completed save
also survives a power loss. A killed save leaves its temporary directory behind, with an
`.owner` file naming the host and process that wrote it: a manager opened later on that
host removes it once that process is gone (a save still running is left alone).
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Deque, List, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

import torch_xla
import torch_xla.core.xla_model as xm

from . import _preemption
from ._helpers import _sharded_cpu_state_dict
from .planners import SPMDLoadPlanner, SPMDSavePlanner

_MANAGER_METADATA_FILE = ".manager_metadata"
_TMP_PREFIX = ".tmp-"
_DEL_PREFIX = ".del-"
_OWNER_FILE = ".owner"


@dataclass
class _CheckpointMetadata:
    step: int
    ts: float  # creation time (seconds since the epoch)


def _fsync_dir(fs, path: str) -> None:
    """Syncs a local directory's entries (a rename into it) to disk; other stores have no such step."""
    if isinstance(fs, LocalFileSystem):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _start_time(pid: int) -> Optional[str]:
    """When process `pid` started (clock ticks since boot, from /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _abandoned(fs, tmp: str) -> bool:
    """Whether temporary directory `tmp` was left by a save whose process is gone (known
    only for a process of this host; a pid taken again by another process does not count)."""
    owner = None
    for name in (_OWNER_FILE, _OWNER_FILE + ".tmp"):   # a save killed before its rename: whole, or no JSON
        try:
            with fs.open(posixpath.join(tmp, name), "r") as f:
                owner = json.load(f)
            host, pid, start = owner["host"], int(owner["pid"]), owner["start"]
            break
        except Exception:  # noqa: BLE001 - not recorded (yet)
            owner = None
    if owner is None:
        return False
    if host != socket.gethostname():
        return False
    if start is not None and _start_time(os.getpid()) is not None:
        return _start_time(pid) != start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _file_sizes(fs, root: str) -> dict:
    """{path relative to `root`: size} of every file below `root`."""
    root = root.rstrip("/")
    found = fs.find(root, detail=True)
    return {posixpath.relpath(p, root): int(info["size"]) for p, info in found.items()
            if info.get("type", "file") == "file"}


def _read_complete(fs, path: str) -> _CheckpointMetadata:
    """The metadata of the complete checkpoint at `path`; ValueError / OSError otherwise."""
    with fs.open(posixpath.join(path, _MANAGER_METADATA_FILE), "r") as f:
        md = json.load(f)
    step, ts = int(md["step"]), float(md["ts"])
    if posixpath.basename(path.rstrip("/")) != str(step):
        raise ValueError(f"{path} holds the checkpoint of step {step}")
    files = md.get("files")
    if files is None:
        # written before the manager recorded its files: complete when PyTorch's metadata is there
        files = {".metadata": None}
    have = _file_sizes(fs, path)
    for name, size in files.items():
        if name not in have or (size is not None and have[name] != size):
            raise ValueError(f"{path}: {name} is missing or of another size than written")
    return _CheckpointMetadata(step=step, ts=ts)


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
                name = posixpath.basename(entry.rstrip("/"))
                if self._is_primary() and (name.startswith(_DEL_PREFIX) or (
                        name.startswith(_TMP_PREFIX) and _abandoned(fs, entry))):
                    self._remove(fs, entry)   # an interrupted deletion, or a killed save
                if name.startswith("."):
                    continue
                try:
                    found.append(_read_complete(fs, entry))
                except Exception:  # noqa: BLE001 - an unreadable or incomplete directory is no checkpoint
                    invalid.append(entry)
        if invalid:
            logging.warning(f"Ignoring invalid checkpoints: {invalid}")
        return deque(sorted(found, key=lambda m: m.ts))

    @staticmethod
    def _remove(fs, raw: str) -> None:
        try:
            fs.rm(raw, recursive=True)
        except FileNotFoundError:
            pass   # removed meanwhile by another manager over the same path

    def _delete_chkpt_at_step(self, step: int) -> None:
        """Renames the checkpoint aside, then removes it: a deletion that is interrupted
        leaves no directory that looks like a checkpoint but lacks files."""
        if self._is_primary():
            fs, raw = url_to_fs(self._get_path(step))
            if not fs.exists(raw):
                return
            aside = posixpath.join(posixpath.dirname(raw.rstrip("/")),
                                   f"{_DEL_PREFIX}{step}-{os.urandom(6).hex()}")
            fs.mv(raw, aside, recursive=True)
            _fsync_dir(fs, posixpath.dirname(aside))
            self._remove(fs, aside)

    def _release_oldest_checkpoints(self) -> None:
        if self.max_to_keep > 0:
            while len(self._tracked_chkpts) > self.max_to_keep:
                self._delete_chkpt_at_step(self._tracked_chkpts.popleft().step)

    def _wait_for_data(self) -> None:
        torch_xla.sync()
        xm.wait_device_ops()

    def _tmp_path(self, step: int) -> str:
        # a fresh directory per save (never one a killed save left behind), named alike by
        # every process; the token crosses as a tensor, not a pickle
        token = torch.tensor([int.from_bytes(os.urandom(6), "big") if self._is_primary() else 0],
                             dtype=torch.int64)
        if self._distributed:
            dist.broadcast(token, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        return os.path.join(self.base_path, f"{_TMP_PREFIX}{step}-{int(token[0]):012x}")

    def _write_marker(self, fs, raw_tmp: str, metadata: _CheckpointMetadata) -> None:
        """`.manager_metadata`, written last: the step and the size of every file of the checkpoint."""
        text = json.dumps({"step": metadata.step, "ts": metadata.ts, "files": _file_sizes(fs, raw_tmp)})
        path = posixpath.join(raw_tmp, _MANAGER_METADATA_FILE)
        if isinstance(fs, LocalFileSystem):
            with open(path, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(fs, raw_tmp)
        else:
            with fs.open(path, "w") as f:
                f.write(text)

    def _save(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """Writes the checkpoint of `step` (the data must be ready: see `_wait_for_data`)."""
        with self._save_mutex:
            tmp = self._tmp_path(step)
            fs, raw_tmp = url_to_fs(tmp)
            try:
                if self._is_primary():
                    # before any process writes there: who to ask whether the save still runs
                    fs.makedirs(raw_tmp, exist_ok=True)
                    owner = posixpath.join(raw_tmp, _OWNER_FILE)
                    with fs.open(owner + ".tmp", "w") as f:
                        json.dump(_owner(), f)
                    fs.mv(owner + ".tmp", owner)
                dist_cp.save(state_dict=state_dict,
                             storage_writer=FsspecWriter(tmp, thread_count=self.num_of_threads),
                             planner=SPMDSavePlanner(), process_group=self.pg,
                             no_dist=not self._distributed)
                metadata = _CheckpointMetadata(step=step, ts=time.time())
                self._barrier()
                if self._is_primary():
                    self._write_marker(fs, raw_tmp, metadata)
                    self._delete_chkpt_at_step(step)
                    _, raw_final = url_to_fs(self._get_path(step))
                    fs.mv(raw_tmp, raw_final, recursive=True)
                    _fsync_dir(fs, posixpath.dirname(raw_final.rstrip("/")))
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
        fs, raw = url_to_fs(self._get_path(step))
        try:
            _read_complete(fs, raw)
        except (OSError, ValueError) as e:
            raise ValueError(f"the checkpoint of step {step} is no longer complete ({e})") from e
        dist_cp.load(state_dict=state_dict, storage_reader=FsspecReader(self._get_path(step)),
                     planner=SPMDLoadPlanner(), process_group=self.pg, no_dist=not self._distributed)

    def load(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """Same as `restore`."""
        self.restore(step, state_dict)

    def all_steps(self) -> List[int]:
        """The steps of all tracked checkpoints (complete when found, or saved by this
        manager), ascending: `max(all_steps())` is the last complete one."""
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

