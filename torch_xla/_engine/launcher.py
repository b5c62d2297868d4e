"""Process management for multi-process jobs: `xmp.spawn` / `torch_xla.launch`.

The parent chooses a free coordinator port, starts one process per device with the
TORCH_XLA_JAX_* environment (see job.py), and watches them. The moment a
child exits non-zero (an exception, a signal, `sys.exit(n)`), the others are stopped
(SIGTERM to their process groups, SIGKILL after a grace period) and the parent raises
`ProcessFailedError` naming the rank, with the child's traceback text.

The parent never starts jax: children are started with the `spawn` method by default
and initialise their own runtime. Right after `jax.distributed.initialize` a child runs
a tiny all-reduce over the replica mesh (`warm_up`), so that gloo's communicator —
created at the first collective, with only a 30 s wait for the peers — is built while
the processes are still in step, not at the model's first all-reduce.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import socket
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import env_vars, job, pjrt



class ProcessFailedError(RuntimeError):
    """A spawned replica failed; `rank`, `exitcode` and the child's `traceback` text are attached."""

    def __init__(self, msg: str, rank: int, exitcode: Optional[int], child_traceback: str = ""):
        super().__init__(msg)
        self.rank = rank
        self.exitcode = exitcode
        self.child_traceback = child_traceback


def _grace_s() -> float:
    return env_vars.get("TORCH_XLA_JAX_KILL_GRACE_S")


def default_nprocs() -> int:
    """How many processes a launch starts on this host: one per device (CPU: CPU_NUM_DEVICES)."""
    pjrt = env_vars.get("PJRT_DEVICE").upper()
    if pjrt in ("", "CPU"):
        v = env_vars.raw("CPU_NUM_DEVICES") or "1"
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"CPU_NUM_DEVICES={v!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"CPU_NUM_DEVICES={n} must be at least 1")
        return n
    # Other platforms: one process owns all of this host's devices.
    return 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the child side ------------------------------------------------------------------------

def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans if the parent is killed)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        # Not Linux with glibc (no libc.so.6, or no prctl): the replica runs without the
        # signal, as it would under any other launcher; the parent still stops it.
        pass


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _child_main(rank: int, env: Dict[str, str], parent_pid: int, workdir: str, fn: Callable,
                args: tuple, eager_init: bool) -> None:
    """Entry point of a spawned replica."""
    env_vars.update(env)
    # A forked replica inherits its parent's device index (xla:0) if the parent asked for
    # its device; this replica's index follows from its rank (runtime.device_index).
    pjrt.forget_device_index()
    try:
        os.setpgrp()  # own process group: the parent can stop this child and its helpers at once
    except OSError:
        pass
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before we set the death signal
        os._exit(1)
    try:
        job.check_environment()
        job.check_coordinator_port()
        if eager_init:
            pjrt.jax_module()   # jax.distributed.initialize + warm-up: every replica waits here
        result = fn(rank, *args)
        _write_atomic(os.path.join(workdir, f"result-{rank}.pkl"), _pickle_result(result, rank))
    except SystemExit as e:
        code = e.code
        if code in (None, 0):
            _flush()
            raise
        text = f"SystemExit({code!r}) raised in replica {rank}:\n" + traceback.format_exc()
        text += _record_error(workdir, rank, text)
        sys.stderr.write(f"[replica {rank}] " + text)
        _flush()
        os._exit(code if isinstance(code, int) else 1)
    except BaseException:
        text = traceback.format_exc()
        text += _record_error(workdir, rank, text)
        sys.stderr.write(f"[replica {rank}] " + text)
        _flush()
        # Exit at once: atexit handlers (jax.distributed.shutdown waits for the peers) would hang.
        os._exit(1)
    _flush()


_PICKLE_ERRORS = (pickle.PicklingError, TypeError, AttributeError)


def _unpicklable_part(value: Any, path: str = "") -> tuple:
    """(where, what) of the innermost item of `value`'s lists, tuples and dicts that does
    not pickle (`value` itself when none of its items is to blame)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        items = ()
    for k, v in items:
        try:
            pickle.dumps(v)
        except _PICKLE_ERRORS:
            return _unpicklable_part(v, f"{path}[{k!r}]")
    return path, value


def _pickle_result(result: Any, rank: int) -> bytes:
    """`result` pickled for the parent; TypeError naming the type when it cannot be."""
    try:
        return pickle.dumps(result)
    except _PICKLE_ERRORS as e:
        where, what = _unpicklable_part(result)
        at = f" (at result{where})" if where else ""
        raise TypeError(f"replica {rank} returned a {type(what).__module__}.{type(what).__qualname__}{at}, "
                        f"which cannot be pickled to reach the parent process ({type(e).__name__}: {e}); "
                        f"return picklable values (CPU tensors, numbers, containers of them)") from e


def _record_error(workdir: str, rank: int, text: str) -> str:
    """Writes the failure's text where the parent reads it; "" or why it could not be written."""
    try:
        _write_atomic(os.path.join(workdir, f"error-{rank}.txt"), text.encode())
    except OSError as e:
        # The replica is failing already: the parent then reports its exit code, and
        # stderr (where the text goes next) says why the report has no traceback.
        return f"(could not record this traceback for the parent: {e})\n"
    return ""


def _flush():
    for s in (sys.stdout, sys.stderr):
        if s is None:  # no console (pythonw, a detached process)
            continue
        try:
            s.flush()
        except (OSError, ValueError):
            # A closed stream (ValueError) or a gone reader (BrokenPipeError) while the
            # replica exits: there is nobody left to show the output to.
            pass


# ---- the parent side ----------------------------------------------------------------------

_env_lock = threading.Lock()


def _signal_group(pid: int, sig: int) -> None:
    for target in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
        try:
            target()
        except (ProcessLookupError, PermissionError, OSError):
            pass


class ProcessContext:
    """The running replicas of one launch (returned by `spawn(join=False)`)."""

    def __init__(self, procs: List[multiprocessing.process.BaseProcess], workdir: str):
        self.processes = procs
        self.workdir = workdir
        self._results: Dict[int, Any] = {}
        self._done = False

    def pids(self) -> List[int]:
        return [p.pid for p in self.processes]

    def _error_text(self, rank: int) -> str:
        path = os.path.join(self.workdir, f"error-{rank}.txt")
        try:
            with open(path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM every live replica (and its helpers), SIGKILL after the grace period, reap."""
        live = [p for p in self.processes if p.exitcode is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _grace_s()
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            # Kill stragglers, and any helper left in a child's process group.
            _signal_group(p.pid, signal.SIGKILL)
        for p in self.processes:
            p.join(5)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for all replicas; True when all exited cleanly. Raises on a failure."""
        from multiprocessing.connection import wait
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                failed = [r for r, p in enumerate(self.processes) if p.exitcode not in (None, 0)]
                if failed:
                    rank = self._root_cause(failed)
                    self._fail(rank, self.processes[rank])
                live = [p for p in self.processes if p.exitcode is None]
                if not live:
                    self._finish()
                    return True
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                wait([p.sentinel for p in live], timeout=remaining if remaining is not None else 1.0)
        except BaseException:
            # KeyboardInterrupt, our own ProcessFailedError, anything: no replica survives us.
            self.terminate()
            self._cleanup()
            raise

    def _root_cause(self, failed: List[int]) -> int:
        """Of replicas found dead together, the one that failed first.

        A replica killed by a signal leaves no traceback and is taken as the cause (its
        peers' errors are the consequence); otherwise the earliest traceback file wins.
        """
        if len(failed) == 1:
            return failed[0]
        by_signal = [r for r in failed if (self.processes[r].exitcode or 0) < 0]
        if by_signal:
            return by_signal[0]

        def when(r):
            try:
                return os.stat(os.path.join(self.workdir, f"error-{r}.txt")).st_mtime_ns
            except OSError:
                return float("inf")
        return min(failed, key=when)

    def _fail(self, rank: int, p) -> None:
        code = p.exitcode
        self.terminate()
        text = self._error_text(rank)
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        msg = f"replica (process) {rank} of {len(self.processes)} {how}; the other replicas were stopped"
        if text:
            msg += f".\n\n-- traceback of replica {rank} --\n{text}"
        elif code is not None and code > 0:
            msg += (f". No traceback was recorded: replica {rank} failed before running the function "
                    f"(importing the main module or unpickling the function/arguments; is the launch "
                    f"under `if __name__ == '__main__':`?); see its stderr above")
        raise ProcessFailedError(msg, rank, code, text)

    def _finish(self) -> None:
        try:
            for rank in range(len(self.processes)):
                self._results[rank] = self._load_result(rank)
        finally:
            self._done = True
            self._cleanup()

    def _load_result(self, rank: int) -> Any:
        path = os.path.join(self.workdir, f"result-{rank}.pkl")
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None  # the replica left through sys.exit(0) before returning
        with f:
            try:
                return pickle.load(f)
            except Exception as e:  # noqa: BLE001  (unpickling runs the result's own code)
                raise RuntimeError(f"the result of replica {rank} could not be unpickled in the parent "
                                   f"process: {type(e).__name__}: {e}") from e

    def _cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def results(self) -> Dict[int, Any]:
        return dict(self._results)


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 2, start_method: str = "spawn",
                    daemon: bool = False, eager_init: bool = True,
                    coordinator: Optional[str] = None) -> ProcessContext:
    """Starts `nprocs` replicas of `fn(index, *args)` on this host, each owning one device."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    if coordinator is None:
        coordinator = f"127.0.0.1:{free_port()}"
    else:
        host, _, port = coordinator.rpartition(":")
        job.check_port_free(host, int(port))
    ctx = multiprocessing.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="torch_xla_launch_")
    procs = []
    context = ProcessContext(procs, workdir)
    try:
        for rank in range(nprocs):
            env = {
                "TORCH_XLA_JAX_PROCESS_ID": str(rank),
                "TORCH_XLA_JAX_WORLD_SIZE": str(nprocs),
                "TORCH_XLA_JAX_LOCAL_RANK": str(rank),
                "TORCH_XLA_JAX_LOCAL_WORLD_SIZE": str(nprocs),
                "TORCH_XLA_JAX_COORDINATOR": coordinator,
            }
            p = ctx.Process(target=_child_main, args=(rank, env, os.getpid(), workdir, fn, tuple(args), eager_init),
                            daemon=daemon, name=f"xla-replica-{rank}")
            with _env_lock:
                # The child's environment is set from its very start (before any import).
                with env_vars.overlay(env):
                    p.start()
            procs.append(p)
    except BaseException:
        context.terminate()
        context._cleanup()
        raise
    return context


def spawn(fn: Callable, args: tuple = (), nprocs: Optional[int] = None, join: bool = True,
          daemon: bool = False, start_method: str = "spawn", return_results: bool = False):
    """`xmp.spawn`: one replica of `fn(index, *args)` per device.

    - Under torchrun (or inside a launched replica) no process is started: `fn(local_rank,
      *args)` runs here.
    - With one process (nprocs=1, or one device) `fn(0, *args)` runs here; its result is
      returned.
    - Otherwise: with join=True, waits and returns None (or {rank: result} when
      `return_results`); a replica failing raises ProcessFailedError after stopping the
      others. With join=False, returns the ProcessContext.
    """
    if job.under_torchrun() or job.in_launched_child():
        job.check_environment()
        return fn(job.local_ordinal(), *args)
    n = default_nprocs() if nprocs is None else int(nprocs)
    if n == 1:
        return fn(0, *args)
    context = start_processes(fn, args, nprocs=n, start_method=start_method, daemon=daemon)
    if not join:
        return context
    context.join()
    return context.results() if return_results else None
