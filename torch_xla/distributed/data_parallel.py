"""Thread-based data parallelism over the devices of one process (`DataParallel`).

Each device gets its own copy of the network and a thread that runs the user's loop
function on its share of the batches. This engine gives a process one device
(multi-device jobs run one process per device: `torch_xla.launch`), so with the default
devices the loop runs on one thread; without xla devices it runs on the CPU model.
"""
from __future__ import annotations

import copy
import sys
import threading
import traceback
from typing import Any, Callable, List, Optional

import torch

from . import parallel_loader as pl
from ..core import xla_model as xm


class Context:
    """Per-device state that lives as long as the `DataParallel` object."""

    def __init__(self, device: torch.device):
        self.device = device

    def getattr_or(self, name: str, defval):
        """The attribute `name`, first set to `defval` (or `defval()` if callable)."""
        value = getattr(self, name, None)
        if value is None:
            value = defval() if callable(defval) else defval
            setattr(self, name, value)
        return value


class DataParallel:
    """Runs a loop function on a copy of `network` per device, one thread each.

    network: a `torch.nn.Module`, or a callable returning one.
    device_ids: the devices (default: `xm.get_xla_supported_devices()`); empty: the
      network runs as it is (on its own device).
    """

    def __init__(self, network, device_ids: Optional[List] = None, **kwargs):
        if device_ids is None:
            device_ids = xm.get_xla_supported_devices()
        self._device_ids = [str(d) for d in device_ids]
        self._kwargs = kwargs
        module = network if isinstance(network, torch.nn.Module) else network()
        self._models = [copy.deepcopy(module).to(device=torch.device(d)) for d in self._device_ids]
        self._contexts = [Context(torch.device(d)) for d in self._device_ids]
        self._native_run = not self._models
        if self._native_run:
            device = self._model_device(module)
            self._models.append(module)
            self._device_ids.append(device)
            self._contexts.append(Context(torch.device(device)))

    @property
    def devices(self) -> List[str]:
        return self._device_ids

    @property
    def models(self) -> List[torch.nn.Module]:
        return self._models

    @staticmethod
    def _model_device(model) -> str:
        devices = {str(p.device) for p in model.parameters()}
        if len(devices) > 1:
            raise RuntimeError(f'Model uses more than one device: {sorted(devices)}')
        return devices.pop() if devices else 'cpu'

    def __call__(self, loop_fn: Callable, loader, batchdim: int = 0, **kwargs) -> List[Any]:
        """Runs one epoch: `loop_fn(model, device_loader, device, context, **kwargs)` per
        device; returns their results in device order (`batchdim`: the batch dimension of
        the loader's samples). With one device the loop runs in the calling
        thread (its exceptions propagate); with several, one thread each, and an exception in
        one thread ends the process (the others would wait forever in their collectives)."""
        if self._native_run:
            return [loop_fn(self._models[0], enumerate(loader), torch.device(self._device_ids[0]),
                            self._contexts[0], **kwargs)]
        xm.wait_device_ops()
        para_loader = pl.ParallelLoader(loader, self._device_ids, batchdim=batchdim, **self._kwargs)
        results: List[Any] = [None] * len(self._models)

        def run(i, device):
            try:
                results[i] = loop_fn(self._models[i], para_loader.per_device_loader(device),
                                     torch.device(device), self._contexts[i], **kwargs)
            except Exception as e:  # noqa: BLE001 - reported, then fatal (see docstring)
                results[i] = e
                print(f'Exception in model function for device={device}: {e}', file=sys.stderr)
                traceback.print_exc(limit=16, file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                import os
                os._exit(17)

        if len(self._models) == 1:
            try:
                device = self._device_ids[0]
                return [loop_fn(self._models[0], para_loader.per_device_loader(device), torch.device(device),
                                self._contexts[0], **kwargs)]
            finally:
                para_loader.close()
        threads = [threading.Thread(target=run, args=(i, d), daemon=True) for i, d in enumerate(self._device_ids)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        para_loader.close()
        return results
