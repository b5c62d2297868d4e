"""Storages and the xla device: `torch.load(..., map_location='xla')` and the kernels of
`set_(Storage, ...)` (patch registry entry `load_to_device`).

xla tensors have no storage: their values live in the XLA runtime (`t._xla`). PyTorch's
own deserializer of a PrivateUse1 location copies each loaded CPU storage to the device
(`storage.to(device)`), which allocates a storage with the PrivateUse1 allocator; there
is none (Python cannot register one), and the process died of a segmentation fault.

Here a deserializer that runs before PyTorch's takes the locations naming the xla device
(`xla`, `xla:N`) and returns an xla storage that holds no bytes but carries the CPU
storage it stands for (`_xla_host`, an attribute of the Python storage object). PyTorch
then rebuilds each tensor as `torch.empty((0,), dtype, device=xla).set_(storage, offset,
size, stride)` (`torch._utils._rebuild_tensor`). Functionalization turns that `set_` of
the user's wrapper into the functional `set.source_Storage_storage_offset` on the inner
tensor, passing the same Python storage object, and replaces the wrapper's value (sizes
included) with the result: the kernel below builds that view of the carried CPU storage
and uploads it. Any other xla storage carries nothing, and `set_` with it is a
RuntimeError naming the op.

Storages shared by several tensors: PyTorch keeps a loaded storage for the next tensor
naming it only when its data pointer is not null; ours reports the CPU storage's
(`HostBackedStorage`), so a record is read once and every tensor on it gets the same
storage object. Each tensor then uploads its own view: values are right, aliasing between
the loaded tensors is not kept (a model's tied parameters stay tied through
`load_state_dict`, which copies into them).

The allocator is reached by other Python paths too (`torch.UntypedStorage(n,
device='xla')`, `TypedStorage(n, device='xla')`, `cpu_storage.to(device='xla')`,
`xla_storage.clone()`): `UntypedStorage.__new__` refuses the xla device with a
RuntimeError instead.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch

from .. import patches
from ..tensor import point_at, wrap_user
from .values import check_device, from_cpu

# The attribute of an xla storage's Python object that holds the CPU storage it stands for.
HOST_ATTR = "_xla_host"
_LOCATION = re.compile(r"xla(:\d+)?$")


def _refuse_empty(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op}: this storage of the xla device holds no data (xla tensors keep their values in the "
        f"XLA runtime, not in a storage), so a tensor cannot be set from it. Use tensor.set_(other_tensor), "
        f"or torch.load(f, map_location='xla') for checkpoints")


def _host(source: Any) -> Optional[torch.UntypedStorage]:
    """The CPU storage `source` carries, or `source` itself when it is a CPU storage (the
    CPU fallback used to serve `xla_tensor.set_(cpu_storage)` with a copy: kept)."""
    if source is None:
        return None
    host = getattr(source, HOST_ATTR, None)
    if host is None and source.device.type == "cpu":
        host = source
    return host


def _host_view(self: torch.Tensor, source: Any, offset: int, size: Optional[Sequence[int]],
               stride: Optional[Sequence[int]], op: str) -> torch.Tensor:
    """The CPU tensor `set_` would make of the CPU storage `source` stands for (`size`
    None: `set_(storage)`, the whole storage as a 1-d tensor of `self`'s dtype)."""
    host = _host(source)
    if host is None:
        raise _refuse_empty(op)
    if size is None:
        size = [host.nbytes() // self.dtype.itemsize]
    cpu = torch.empty((0,), dtype=self.dtype)
    # PyTorch's own set_ checks the view against the storage's size.
    return cpu.set_(host, int(offset), [int(v) for v in size], [int(v) for v in (stride or [])])


def k_set_storage(self: torch.Tensor, source: Any, storage_offset: int, size: Sequence[int],
                  stride: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`set.source_Storage_storage_offset` (the functional form functionalization calls):
    a new tensor holding the view of the carried CPU storage."""
    cpu = _host_view(self, source, storage_offset, size, stride, "aten::set_.source_Storage_storage_offset")
    return wrap_user(from_cpu(cpu))


def k_set_storage_whole(self: torch.Tensor, source: Any) -> torch.Tensor:
    cpu = _host_view(self, source, 0, None, None, "aten::set_.source_Storage")
    return wrap_user(from_cpu(cpu))


def _set_inner(self: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Makes inner tensor `self` hold inner tensor `new`'s value and sizes."""
    self.data = new  # the new sizes and strides; the Python object and its state stay
    s = getattr(self, "_xla", None)
    if s is None:
        self._xla = new._xla
    else:
        s.shape, s.dtype = new._xla.shape, new._xla.dtype
        point_at(s, new._xla)
    return self


def k_set_storage_(self: torch.Tensor, source: Any, storage_offset: int, size: Sequence[int],
                   stride: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`set_.source_Storage_storage_offset` on an inner tensor (below functionalization)."""
    cpu = _host_view(self, source, storage_offset, size, stride, "aten::set_.source_Storage_storage_offset")
    return _set_inner(self, from_cpu(cpu))


def k_set_storage_whole_(self: torch.Tensor, source: Any) -> torch.Tensor:
    cpu = _host_view(self, source, 0, None, None, "aten::set_.source_Storage")
    return _set_inner(self, from_cpu(cpu))


KERNELS = {
    "set.source_Storage_storage_offset": k_set_storage,
    "set.source_Storage": k_set_storage_whole,
    "set_.source_Storage_storage_offset": k_set_storage_,
    "set_.source_Storage": k_set_storage_whole_,
}


# ---- torch.load -----------------------------------------------------------------------------

# Before PyTorch's own deserializers (cpu 10, cuda 20, mps 21, meta 22, privateuse1 23): a
# location naming the xla device must never reach the privateuse1 one, which crashes.
PRIORITY = 9


class HostBackedStorage(torch.UntypedStorage):
    """The class of the xla storages `_deserialize` returns: an xla storage (no bytes) that
    stands for the CPU storage in its `_xla_host` attribute.

    Its `data_ptr()` is that CPU storage's: `torch.load` keeps a loaded storage for the
    next tensor of the same record only when its data pointer is not null, so without it
    every view of a storage read (and held) the whole record again; a checkpoint of many
    views of one flat buffer would read that buffer once per view."""
    __slots__ = ()

    def data_ptr(self) -> int:
        host = getattr(self, HOST_ATTR, None)
        return host.data_ptr() if host is not None else 0


def _tag(storage: Any) -> None:
    """Saving is unchanged (PyTorch's own taggers name the storage's device)."""
    return None


def _deserialize(storage: Any, location: str) -> Optional[torch.UntypedStorage]:
    """A storage of the xla device that carries CPU storage `storage`, for a location
    naming the xla device; None (the next deserializer) for any other location."""
    if not isinstance(location, str) or not _LOCATION.match(location):
        return None
    check_device(location)
    if getattr(storage, "_torch_load_uninitialized", False):
        # The legacy (non-zip) format rebuilds every tensor before it reads the data into
        # the storages: the values are not there yet when set_ would upload them.
        raise RuntimeError(
            f"torch.load: this checkpoint is in PyTorch's legacy (non-zip) format, which fills the storages "
            f"after building the tensors; it cannot be loaded onto {location} directly. Load it with "
            f"map_location='cpu' and move the result with .to('xla') (or save it again with torch.save)")
    if storage.device.type != "cpu":
        storage = storage.cpu()
    # A fresh wrapper's storage is a new storage object of this process's device (the
    # functional wrapper's own), so the attribute below belongs to this load only.
    out = torch.empty((0,), dtype=torch.uint8, device="xla").untyped_storage()
    out.__class__ = HostBackedStorage   # same layout: only data_ptr differs
    setattr(out, HOST_ATTR, storage)
    return out


# ---- the allocator ---------------------------------------------------------------------------

_orig_new = torch.UntypedStorage.__new__


def _storage_new(cls, *args: Any, **kwargs: Any):
    """`torch.UntypedStorage(...)`, refusing the xla device: there is no storage to
    allocate there (and PyTorch would call the missing allocator)."""
    device = kwargs.get("device")
    if device is not None and not isinstance(device, int) and torch.device(device).type == "xla":
        raise RuntimeError(
            f"torch.UntypedStorage on {device}: xla tensors keep their values in the XLA runtime and have "
            f"no storage, so no storage of the xla device can be allocated. Make a tensor instead "
            f"(torch.empty(n, dtype=torch.uint8, device='xla')) or keep the storage on the CPU; "
            f"torch.load(f, map_location='xla') loads checkpoints onto the device")
    return _orig_new(cls, *args, **kwargs)


def install_load() -> bool:
    """Patch `load_to_device`: registers the deserializer."""
    if not patches.signature_matches(torch.serialization.register_package, ["priority", "tagger", "deserializer"],
                                     "torch.serialization.register_package"):
        return False
    torch.serialization.register_package(PRIORITY, _tag, _deserialize)
    return True


def install_storage_check() -> bool:
    """Patch `xla_storage_refused`: `torch.UntypedStorage(..., device=xla)` raises. A builtin
    `__new__` has no signature to check: an `UntypedStorage` with a Python `__new__` of its
    own is left alone."""
    if "__new__" in torch.UntypedStorage.__dict__ or torch.UntypedStorage.__new__ is not _orig_new:
        return patches.refuse("torch.UntypedStorage.__new__", "it is not PyTorch's builtin one")
    torch.UntypedStorage.__new__ = staticmethod(_storage_new)
    return True
