"""`torch_xla.distributed.parallel_loader` (pl): device loaders with background upload.

`ParallelLoader` wraps a data loader: one background thread reads batches from it
(the i-th batch goes to ``devices[i % len(devices)]``) into a bounded per-device host
queue, and `host_to_device_transfer_threads` threads per device move them to the
device into a bounded device queue. The per-device iterator hands the batches out in
loader order and issues the barrier (`xm.mark_step()`) before every
`batches_per_execution`-th batch and once more at the end of the data.

Threads hold only the loader's shared state, never the `ParallelLoader` object, so
dropping the last reference to the loader (or to its per-device iterator, e.g. a
`break` out of a `for` loop over an `MpDeviceLoader`) closes it and its threads exit.
An exception raised by the wrapped loader, or by a transfer, is re-raised by the
per-device iterator at the position of the failing batch.
"""
from __future__ import annotations

import atexit
import collections
import threading
import weakref
from typing import Any, Dict, List

import torch

import torch_xla.core.xla_model as xm
from torch_xla._engine import patches as _patches
from torch_xla._engine.executor import analysis as _analysis

_AT_STEP_END = "torch_xla.sync in parallel loader at step end"

_END = object()   # end of a queue's data


class _Failure:
    """An exception travelling through the queues to the consumer."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Queue:
    """A bounded FIFO whose waits end when it is closed.

    `close_write()`: no more items will be put; `get()` returns `_END` once drained.
    `close()`: the consumer is gone; pending items are dropped, `put()` returns False
    and `get()` returns `_END` at once.
    """

    def __init__(self, maxsize: int):
        self._maxsize = max(1, int(maxsize))
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._write_closed = False
        self._closed = False

    def put(self, item) -> bool:
        with self._cond:
            while len(self._items) >= self._maxsize and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            while not self._items and not self._write_closed and not self._closed:
                self._cond.wait()
            if self._closed or not self._items:
                return _END
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close_write(self) -> None:
        with self._cond:
            self._write_closed = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class _DeviceQueues:
    """The host and device queues of one device, and its consumer's reordering buffer."""

    def __init__(self, device: torch.device, loader_prefetch_size: int, device_prefetch_size: int,
                 transfer_threads: int):
        self.device = device
        self.loader_queue = _Queue(loader_prefetch_size)
        self.queue = _Queue(device_prefetch_size)
        self.active_transfers = transfer_threads
        self.next_seq = 0           # consumer side: the next batch (in loader order) to return
        self.arrived: Dict[int, Any] = {}
        self.exhausted = False


class _State:
    """Everything the worker threads need; deliberately no reference to the ParallelLoader."""

    def __init__(self, loader, queues: List[_DeviceQueues], input_sharding):
        self.loader = loader
        self.queues = queues
        self.input_sharding = input_sharding
        self.done = False
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []

    def close(self) -> None:
        self.done = True
        for dq in self.queues:
            dq.loader_queue.close()
            dq.queue.close()


_live_states: "weakref.WeakSet[_State]" = weakref.WeakSet()


def register_exit_hook() -> None:
    """Patch `close_loaders_at_exit`."""
    atexit.register(_close_all_at_exit)


def _close_all_at_exit() -> None:
    states = list(_live_states)
    for s in states:
        s.close()
    for s in states:
        for th in s.threads:
            if th is not threading.current_thread():
                th.join(timeout=1.0)


def _loader_worker(state: _State) -> None:
    queues = state.queues
    seqs = [0] * len(queues)
    it = None
    try:
        it = iter(state.loader)
        group = []
        while not state.done:
            try:
                data = next(it)
            except StopIteration:
                break
            group.append(data)
            if len(group) == len(queues):
                # The i-th batch goes to device i % len(devices); an incomplete last
                # group is dropped so that every device gets the same number of batches.
                for i, (dq, item) in enumerate(zip(queues, group)):
                    if not dq.loader_queue.put((seqs[i], item)):
                        return
                    seqs[i] += 1
                group = []
    except BaseException as e:  # noqa: BLE001 - handed to the consumer
        for i, dq in enumerate(queues):
            dq.loader_queue.put((seqs[i], _Failure(e)))
    finally:
        del it
        for dq in queues:
            dq.loader_queue.close_write()


def _flatten(data, leaves: list):
    """Collects the tensors of a nested batch (lists, tuples, dicts, DataWrappers) in order."""
    from torch_xla.utils.utils import DataWrapper
    if isinstance(data, torch.Tensor):
        leaves.append(data)
    elif isinstance(data, DataWrapper):
        leaves.extend(data.get_tensors())
    elif isinstance(data, dict):
        for v in data.values():
            _flatten(v, leaves)
    elif isinstance(data, (list, tuple)):
        for v in data:
            _flatten(v, leaves)


def _unflatten(data, it):
    from torch_xla.utils.utils import DataWrapper
    if isinstance(data, torch.Tensor):
        return next(it)
    if isinstance(data, DataWrapper):
        return data.from_tensors([next(it) for _ in data.get_tensors()])
    if isinstance(data, dict):
        return _same_mapping_type(data, {k: _unflatten(v, it) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        items = [_unflatten(v, it) for v in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):
            return type(data)(*items)
        try:
            return type(data)(items)
        except TypeError:
            return items if isinstance(data, list) else tuple(items)
    return data


def _send_leaves(leaves: list, device: torch.device, spec) -> list:
    """The tensors of a batch on `device`; in SPMD mode laid out as `spec` says where it
    applies (its rank), otherwise replicated over every device, and annotated so."""
    import torch_xla.runtime as xr
    if not xr.is_spmd():
        return xm.send_cpu_data_to_device(leaves, device, spec)
    from torch_xla._engine import partitioning
    from torch_xla.distributed.spmd.xla_sharding import send_sharded
    out = []
    for t in leaves:
        if spec is not None and spec.can_apply(t):
            out.append(send_sharded(t, spec))
            continue
        moved = t.to(device)
        if t.device.type != "xla":
            partitioning.annotate(moved, partitioning.replicated_sharding())
        out.append(moved)
    return out


def _send_to_device(data, device: torch.device, input_sharding=None):
    if isinstance(input_sharding, dict):
        return _send_dict(data, device, input_sharding)
    leaves: list = []
    _flatten(data, leaves)
    if not leaves:
        return data
    with torch.no_grad():
        moved = _send_leaves(leaves, device, input_sharding)
    return _unflatten(data, iter(moved))


def _send_dict(data, device: torch.device, input_sharding: dict):
    """A dict batch whose entries each have their own sharding spec (`input_sharding[key]`)."""
    if not isinstance(data, dict):
        raise ValueError("input batch should be a dict when input sharding is a dict.")
    missing = [k for k in data if k not in input_sharding]
    if missing:
        raise KeyError(f"Keys: {missing} are missing from input_sharding.")
    out = {}
    with torch.no_grad():
        for k, v in data.items():
            leaves: list = []
            _flatten(v, leaves)
            out[k] = _unflatten(v, iter(_send_leaves(leaves, device, input_sharding[k]))) if leaves else v
    return _same_mapping_type(data, out)


def _same_mapping_type(data: dict, out: dict) -> dict:
    """`out` as `data`'s dict subclass when that type can be built empty, else a plain dict."""
    if type(data) is dict:
        return out
    try:
        typed = type(data)()
    except TypeError:
        return out
    typed.update(out)
    return typed


def _transfer_worker(state: _State, dq: _DeviceQueues) -> None:
    try:
        while not state.done:
            item = dq.loader_queue.get()
            if item is _END:
                break
            seq, data = item
            if not isinstance(data, _Failure):
                try:
                    data = _send_to_device(data, dq.device, state.input_sharding)
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    data = _Failure(e)
            if not dq.queue.put((seq, data)):
                break
    finally:
        with state.lock:
            dq.active_transfers -= 1
            last = dq.active_transfers == 0
        if last:
            dq.queue.close_write()


def _norm_device(device) -> torch.device:
    d = torch.device(device)
    if d.type == "xla" and d.index is None:
        d = xm.xla_device()   # this process's device (xla:<global ordinal> in CPU jobs)
    return d


class PerDeviceLoader:
    """The iterator over one device's batches of a `ParallelLoader`."""

    def __init__(self, loader: "ParallelLoader", device: torch.device):
        self._loader = loader
        self._device = device
        self._batches_yielded = 0
        self._finished = False

    def __iter__(self) -> "PerDeviceLoader":
        return self

    def __next__(self):
        return self.next()

    def __len__(self) -> int:
        return self._loader.per_device_samples()

    def next(self):
        if self._finished:
            raise StopIteration
        # The barrier of the previous `batches_per_execution` batches' computation.
        marked = self._batches_yielded % self._loader.batches_per_execution == 0
        if marked:
            with _analysis.cause(_AT_STEP_END):
                xm.mark_step()
        item = self._loader.next_item(self._device)
        if item is _END:
            self._finished = True
            if not marked:
                with _analysis.cause(_AT_STEP_END):
                    xm.mark_step()   # the computation of the last (partial) group
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            self._loader.close()
            raise item.exc
        self._batches_yielded += 1
        return item

    def close(self) -> None:
        """Stops the loader's background threads (the iteration ends)."""
        self._finished = True
        self._loader.close()


class ParallelLoader:
    """Wraps an existing PyTorch DataLoader with background data upload.

    Args:
      loader: the data loader (any iterable of batches; `len()` is needed for
        `per_device_samples()` and `len()` of the per-device iterators).
      devices (list of torch.device or str): where the batches go; the i-th batch of
        the loader is sent to ``devices[i % len(devices)]``.
      batchdim (int): the batch dimension. Default: 0
      batches_per_execution (int): how many batches one graph execution covers: the
        per-device iterator issues `xm.mark_step()` before handing out every
        `batches_per_execution`-th batch. Default: 1
      loader_prefetch_size (int): capacity of each device's queue of batches read
        from the loader and not yet uploaded. Default: 8
      device_prefetch_size (int): capacity of each device's queue of uploaded batches.
        Default: 4
      host_to_device_transfer_threads (int): upload threads per device. Default: 1
      input_sharding (ShardingSpec or dict of str to ShardingSpec): SPMD mode: the layout
        of the batches' tensors over the mesh (a tensor of another rank than the spec's is
        replicated); a dict gives each key of a dict batch its own spec (a batch that is
        not a dict is a ValueError, a key it lacks a KeyError). None: replicated. Default: None
    """

    def __init__(self, loader, devices, batchdim: int = 0, batches_per_execution: int = 1,
                 loader_prefetch_size: int = 8, device_prefetch_size: int = 4,
                 host_to_device_transfer_threads: int = 1, input_sharding=None):
        if isinstance(devices, (str, torch.device)):
            devices = [devices]
        self._devices = [_norm_device(d) for d in devices]
        if not self._devices:
            raise ValueError("ParallelLoader needs at least one device")
        if len(set(self._devices)) != len(self._devices):
            raise ValueError(f"ParallelLoader devices must be distinct, got {self._devices}")
        if batches_per_execution < 1:
            raise ValueError(f"batches_per_execution must be >= 1, got {batches_per_execution}")
        if host_to_device_transfer_threads < 1:
            raise ValueError("host_to_device_transfer_threads must be >= 1")
        self._loader = loader
        self._batchdim = batchdim
        self._batches_per_execution = int(batches_per_execution)
        self._input_sharding = input_sharding
        self._queues: Dict[torch.device, _DeviceQueues] = {}
        for d in self._devices:
            self._queues[d] = _DeviceQueues(d, loader_prefetch_size, device_prefetch_size,
                                            host_to_device_transfer_threads)
        self._state = _State(loader, list(self._queues.values()), input_sharding)
        _live_states.add(self._state)
        _patches.install("close_loaders_at_exit")
        threads = [threading.Thread(target=_loader_worker, args=(self._state,),
                                    name="xla-parallel-loader", daemon=True)]
        for dq in self._queues.values():
            for i in range(host_to_device_transfer_threads):
                threads.append(threading.Thread(target=_transfer_worker, args=(self._state, dq),
                                                name=f"xla-h2d-{dq.device}-{i}", daemon=True))
        self._state.threads = threads
        for th in threads:
            th.start()

    @property
    def batches_per_execution(self) -> int:
        return self._batches_per_execution

    def per_device_loader(self, device) -> PerDeviceLoader:
        """The iterator of `device`'s batches, already residing on `device`."""
        d = _norm_device(device)
        if d not in self._queues:
            raise ValueError(f"{device} is not one of this loader's devices {self._devices}")
        return PerDeviceLoader(self, d)

    def per_device_samples(self) -> int:
        """How many batches each device receives."""
        return len(self._loader) // len(self._devices)

    def next_item(self, device):
        """The next batch of `device` in loader order; `_END` after the last one."""
        dq = self._queues[_norm_device(device)]
        if self._state.done:            # closed: batches still buffered here are dropped too
            dq.arrived.clear()
            return _END
        while dq.next_seq not in dq.arrived:
            if dq.exhausted:
                if not dq.arrived:
                    return _END
                dq.next_seq = min(dq.arrived)   # a gap only follows a failure; keep order
                break
            item = dq.queue.get()
            if item is _END:
                dq.exhausted = True
                continue
            seq, data = item
            dq.arrived[seq] = data
        data = dq.arrived.pop(dq.next_seq)
        dq.next_seq += 1
        return data

    def close(self) -> None:
        """Stops the background threads; pending batches are dropped."""
        self._state.close()

    def __del__(self):
        state = getattr(self, "_state", None)
        if state is not None:
            try:
                state.close()
            except Exception:  # noqa: BLE001 - e.g. during interpreter shutdown
                pass


class MpDeviceLoader:
    """Wraps a data loader for one device; each `iter()` starts a `ParallelLoader`.

    Args:
      loader: the data loader to wrap.
      device (torch.device): the device the batches go to.
      **kwargs: the `ParallelLoader` options (batches_per_execution, loader_prefetch_size,
        device_prefetch_size, host_to_device_transfer_threads, input_sharding).
    """

    def __init__(self, loader, device, **kwargs):
        self._loader = loader
        self._device = device
        self._parallel_loader_kwargs = kwargs

    def __iter__(self) -> PerDeviceLoader:
        parallel_loader = ParallelLoader(self._loader, [self._device], **self._parallel_loader_kwargs)
        return parallel_loader.per_device_loader(self._device)

    def __len__(self) -> int:
        return len(self._loader)
