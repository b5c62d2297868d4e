"""`torch_xla.utils.serialization` (xser): checkpoints that stream XLA tensors to the host.

`save(data, path)` copies the XLA tensors of `data` to the CPU one at a time, each
into its own file, so host memory holds at most one of them at once; `load(path)`
restores the structure with the tensors on the CPU (move them with `.to(device)` or
`model.load_state_dict`).

Layout on disk, for ``save(data, "ckpt.pt")``:

* ``ckpt.pt.tensors-<token>/tensor_<i>.pt`` - one `torch.save`d CPU tensor per XLA
  tensor (a tensor object appearing several times in `data` is written once);
* ``ckpt.pt`` - `data` with every XLA tensor replaced by a `TensorReference`, plus the
  name of its tensors directory.

The save is atomic: the tensors go to a fresh directory, then ``ckpt.pt`` is written
to a temporary file and renamed over the old one, and only then are the previous
save's tensors removed. An interrupted save leaves the previous checkpoint readable.

`load` also reads the upstream layout (``ckpt.pt`` plus ``ckpt.pt.tensors/``).
"""
from __future__ import annotations

import os
import re
import shutil
import uuid

import torch

import torch_xla.core.xla_model as xm
from torch_xla import runtime as xr

_FORMAT_KEY = "__torch_xla_serialization__"
_FORMAT_VERSION = 1


class TensorReference:
    """Stands in for an XLA tensor in a saved structure: the tensor is in file `tid`."""

    def __init__(self, tid: int, requires_grad: bool = False, is_param: bool = False):
        self.tid = tid
        self.requires_grad = requires_grad
        self.is_param = is_param

    def __setstate__(self, state):
        # Upstream references carry only `tid`.
        self.requires_grad = False
        self.is_param = False
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"


def _tensor_file(folder: str, tid: int) -> str:
    return os.path.join(folder, f"tensor_{tid}.pt")


def _is_xla(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "xla"


def _rewrite(data, folder, write: bool):
    """`data` with XLA tensors replaced by references, streaming each one to `folder`."""
    from torch_xla.utils.utils import for_each_instance_rewrite
    counter = [0]

    def convert(t: torch.Tensor):
        tid = counter[0]
        counter[0] += 1
        if write:
            cpu = t.detach().cpu()
            torch.save(cpu, _tensor_file(folder, tid))
            del cpu
        return TensorReference(tid, requires_grad=bool(t.requires_grad),
                               is_param=isinstance(t, torch.nn.Parameter))

    return for_each_instance_rewrite(data, _is_xla, convert)


def _old_folders(path: str, keep: str):
    d = os.path.dirname(os.path.abspath(path))
    pat = re.compile(re.escape(os.path.basename(path)) + r"\.tensors(-[0-9a-f]{32})?$")
    for name in os.listdir(d):
        if name != keep and pat.match(name) and os.path.isdir(os.path.join(d, name)):
            yield os.path.join(d, name)


def save(data, path, master_only: bool = True, global_master: bool = False) -> None:
    """Saves `data` to `path`, streaming its XLA tensors to the host one at a time.

    Args:
      data: the structure to save (e.g. a state dict); XLA tensors may be nested in
        lists, tuples, sets and dicts.
      path (str): the checkpoint file; the tensors go to a directory next to it.
      master_only (bool): only the master ordinal writes. Default: True
      global_master (bool): with `master_only`, the global master (ordinal 0 of the job)
        writes instead of each host's local master. Default: False
    """
    path = os.fspath(path)
    is_writer = (not master_only) or xm.is_master_ordinal(local=not global_master)
    folder_name = f"{os.path.basename(path)}.tensors-{uuid.uuid4().hex}"
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), folder_name)
    if is_writer:
        os.makedirs(folder)
    try:
        ref_data = _rewrite(data, folder, is_writer)
        if is_writer:
            xm.atomic_save({_FORMAT_KEY: _FORMAT_VERSION, "tensors": folder_name, "data": ref_data}, path)
    except BaseException:
        if is_writer:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if is_writer:
        for old in _old_folders(path, folder_name):
            shutil.rmtree(old, ignore_errors=True)
    if xr.world_size() > 1:
        xm.rendezvous("torch_xla.utils.serialization.save")


def load(path, weights_only: bool = True):
    """Loads data saved by `save`; its tensors are returned on the CPU.

    Args:
      path (str): the checkpoint file given to `save`.
      weights_only (bool): unpickle with `torch.load(..., weights_only=True)` (tensors,
        containers and primitive types only). Pass False to load arbitrary pickled
        objects from a trusted checkpoint. Default: True
    """
    from torch_xla.utils.utils import for_each_instance_rewrite
    path = os.fspath(path)
    if weights_only:
        with torch.serialization.safe_globals([TensorReference]):
            top = torch.load(path, weights_only=True)
    else:
        top = torch.load(path, weights_only=False)
    base = os.path.dirname(os.path.abspath(path))
    if isinstance(top, dict) and top.get(_FORMAT_KEY) == _FORMAT_VERSION:
        folder = os.path.join(base, top["tensors"])
        ref_data = top["data"]
    else:  # the upstream layout
        folder = path + ".tensors"
        ref_data = top

    def convert(ref: TensorReference):
        t = torch.load(_tensor_file(folder, ref.tid), weights_only=True)
        if ref.is_param:
            return torch.nn.Parameter(t, requires_grad=ref.requires_grad)
        if ref.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t

    return for_each_instance_rewrite(ref_data, lambda x: isinstance(x, TensorReference), convert)


__all__ = ["save", "load", "TensorReference"]
