"""Planners for `torch.distributed.checkpoint` that handle sharded xla tensors.

`SPMDSavePlanner` writes a sharded xla tensor piece by piece: each process writes the
replica-0 pieces of its own devices, unpadded, with their offsets in the global tensor
(nothing is gathered). Unsharded xla tensors and CPU values are written whole.

`SPMDLoadPlanner` loads in place: a sharded xla tensor of the target state_dict reads
the parts of the saved pieces that overlap each of its local pieces (so a checkpoint
saved under one mesh loads under another) and receives them with `load_local_shards_`;
an unsharded xla tensor is filled on the CPU and copied to the device once. Non-tensor
items are read with `torch.load(weights_only=True)`: a checkpoint cannot run code.
"""
from __future__ import annotations

import dataclasses
import io
from collections import ChainMap
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.default_planner import (create_default_global_load_plan,
                                                          create_default_global_save_plan,
                                                          create_default_local_load_plan,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   STATE_DICT_TYPE, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import find_state_dict_object

from torch_xla._engine import partitioning as _sh
from torch_xla.distributed.spmd import XLAShard, XLAShardedTensor

from ._helpers import (FLATTEN_MAPPING, _CpuShards, chunk_of, device_lock, fetch_pieces, flatten_state_dict,
                       is_empty, is_xla_tensor, local_layout, narrow_tensor_by_index, pieces_numel,
                       replica0_positions, set_element, sharded_state_dict_parts, sync_tensors,
                       xla_sharding)


def _properties(dtype: torch.dtype) -> TensorProperties:
    return TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                            memory_format=torch.contiguous_format, pin_memory=False)


def _write_item(fqn: str, position: int, index, global_size: torch.Size, dtype: torch.dtype,
                kind: WriteItemType = WriteItemType.SHARD) -> WriteItem:
    offsets, sizes = chunk_of(index)
    return WriteItem(
        index=MetadataIndex(fqn, offsets, position), type=kind,
        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                    properties=_properties(dtype), size=global_size))


def _whole(shape: torch.Size) -> Tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _dedup(all_plans: List[SavePlan]) -> List[SavePlan]:
    """Each item written by one process only: a duplicated item goes to the process with
    the fewest bytes so far (replicated values are in every process's plan)."""
    owners: Dict[MetadataIndex, List[int]] = {}
    for i, plan in enumerate(all_plans):
        for item in plan.items:
            owners.setdefault(item.index, []).append(i)
    load = [0] * len(all_plans)
    keep: Dict[MetadataIndex, int] = {}
    for i, plan in enumerate(all_plans):
        for item in plan.items:
            if len(owners[item.index]) == 1:
                load[i] += item.tensor_storage_size() or 0
    for key, plans in owners.items():
        if len(plans) > 1:
            size = next(it.tensor_storage_size() or 0 for it in all_plans[plans[0]].items if it.index == key)
            best = min(plans, key=lambda p: (load[p], p))
            load[best] += size
            keep[key] = best
    return [dataclasses.replace(plan, items=[it for it in plan.items if keep.get(it.index, i) == i])
            for i, plan in enumerate(all_plans)]


class SPMDSavePlanner(SavePlanner):
    """Save planner for state_dicts holding sharded xla tensors (`XLAShardedTensor`s or
    annotated xla tensors), `_CpuShards` (async checkpoints) and ordinary values."""

    def __init__(self) -> None:
        self.is_coordinator: bool = False
        self.mappings: Optional[FLATTEN_MAPPING] = None
        self.sharded_state_dict: Optional[Dict[str, Any]] = None
        self.unsharded_state_dict: Optional[Dict[str, Any]] = None
        self._pieces: Dict[str, Dict[int, torch.Tensor]] = {}

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: Optional[StorageMeta] = None,
                       is_coordinator: bool = False) -> None:
        if isinstance(storage_meta, bool):  # the v2.9 signature: (state_dict, is_coordinator)
            storage_meta, is_coordinator = None, storage_meta
        self.is_coordinator = is_coordinator
        flat, self.mappings = flatten_state_dict(state_dict)
        sync_tensors(list(flat.values()))
        self.sharded_state_dict, self.unsharded_state_dict = sharded_state_dict_parts(flat)
        self._pieces = {}

    def create_local_plan(self) -> SavePlan:
        host = {k: v for k, v in self.unsharded_state_dict.items() if not is_xla_tensor(v)}
        plan = create_default_local_save_plan(host, self.is_coordinator)
        items = list(plan.items)
        for fqn, v in self.unsharded_state_dict.items():
            if is_xla_tensor(v):
                items.append(_write_item(fqn, 0, _whole(v.shape), v.shape, v.dtype, WriteItemType.TENSOR))
        for fqn, v in self.sharded_state_dict.items():
            if isinstance(v, _CpuShards):
                for pos, s in enumerate(v.shards):
                    if s.replica_id == 0 and not is_empty(tuple(s.indices)):
                        items.append(_write_item(fqn, pos, tuple(s.indices), v.global_shape, s.data.dtype))
            else:
                layout = local_layout(v.global_tensor)
                for pos in replica0_positions(layout):
                    items.append(_write_item(fqn, pos, layout[pos][1], v.shape, v.dtype))
        return dataclasses.replace(plan, items=items, planner_data=self.mappings)

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(_dedup(all_plans), rewrite_index_hints=False)
        merged = dict(ChainMap(*[p.planner_data for p in plans if p.planner_data]))
        return plans, dataclasses.replace(metadata, planner_data=merged)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        return self.transform_object(write_item, self.lookup_object(write_item.index))

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.unsharded_state_dict:
            value = self.unsharded_state_dict[index.fqn]
            if is_xla_tensor(value):
                with device_lock:
                    return value.detach().cpu()
            return find_state_dict_object(self.unsharded_state_dict, index)
        value = self.sharded_state_dict[index.fqn]
        if isinstance(value, _CpuShards):
            shard = value.shards[index.index]
            if torch.Size(s.start for s in shard.indices) != index.offset:
                raise RuntimeError(f"write item {index} does not match the shard at that position")
            return shard.unpadded_data
        layout = local_layout(value.global_tensor)
        if index.fqn not in self._pieces:
            self._pieces[index.fqn] = fetch_pieces(value.global_tensor, replica0_positions(layout))
        if chunk_of(layout[index.index][1])[0] != index.offset:
            raise RuntimeError(f"write item {index} does not match the local shard at that position")
        piece = self._pieces[index.fqn].pop(index.index, None)
        if piece is None:
            raise RuntimeError(f"write item {index} was already resolved")
        return piece

    def transform_object(self, write_item: WriteItem, object: Any) -> Union[torch.Tensor, io.BytesIO]:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(object, buf)
            return buf
        return object


@dataclasses.dataclass
class _Staging:
    """CPU buffers a tensor is read into, and how many elements are still to come."""
    buffers: List[torch.Tensor]
    pending: int
    positions: List[List[int]] = dataclasses.field(default_factory=list)  # layout positions per chunk


def _load_shards_in_place(target: torch.Tensor, shards: List[XLAShard]) -> None:
    """Gives sharded xla tensor `target` the value of `shards` (its local layout's order).

    The shards go to a fresh tensor of the same layout, copied into `target` in place:
    a state_dict holds detached aliases of the parameters, and an in-place copy reaches
    the parameter where replacing the alias's device data would not."""
    src = torch.empty(target.shape, dtype=target.dtype, device=target.device)
    _sh.annotate(src, xla_sharding(target))
    XLAShardedTensor(src).load_local_shards_(shards)
    with torch.no_grad():
        target.copy_(src)


class SPMDLoadPlanner(LoadPlanner):
    """Load planner that restores a checkpoint in place into a state_dict whose sharded
    xla tensors are already on the device, laid out as they should be after the load.

    `allow_partial_load`: keys of the state_dict missing from the checkpoint are skipped
    instead of raising."""

    def __init__(self, allow_partial_load: bool = False) -> None:
        self.allow_partial_load = allow_partial_load
        self.metadata: Optional[Metadata] = None
        self.is_coordinator: bool = False
        self.original_state_dict: Optional[STATE_DICT_TYPE] = None
        self.mappings: Optional[FLATTEN_MAPPING] = None
        self.sharded_state_dict: Optional[Dict[str, XLAShardedTensor]] = None
        self.unsharded_state_dict: Optional[Dict[str, Any]] = None
        self._staging: Dict[str, _Staging] = {}
        self._planned: Dict[str, int] = {}
        self._loaded: List[torch.Tensor] = []
        self._chunks: Dict[str, List[Tuple[slice, ...]]] = {}

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.original_state_dict = state_dict
        flat, self.mappings = flatten_state_dict(state_dict)
        self.sharded_state_dict, self.unsharded_state_dict = sharded_state_dict_parts(flat)
        self._staging, self._planned, self._chunks = {}, {}, {}

    def _saved(self, fqn: str, shape: torch.Size) -> Optional[TensorStorageMetadata]:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            if self.allow_partial_load:
                return None
            raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{fqn} is a sharded tensor here but not a tensor in the checkpoint")
        if md.size != shape:
            raise ValueError(f"Size mismatch between saved {md.size} and current: {shape} for {fqn}")
        return md

    def create_local_plan(self) -> LoadPlan:
        plan = create_default_local_load_plan(self.unsharded_state_dict, self.metadata,
                                              strict=not self.allow_partial_load)
        items = list(plan.items)
        for fqn, t in self.sharded_state_dict.items():
            md = self._saved(fqn, t.shape)
            if md is None:
                continue
            chunks = []
            for _, index, _, _ in local_layout(t.global_tensor):
                if not is_empty(index) and index not in chunks:
                    chunks.append(index)
            self._chunks[fqn] = chunks
            metas = [ChunkStorageMetadata(*chunk_of(c)) for c in chunks]
            items.extend(create_read_items_for_chunk_list(fqn, md, metas))
        self._planned, self._loaded = {}, []
        for item in items:
            fqn = item.dest_index.fqn
            if fqn in self.sharded_state_dict or is_xla_tensor(self.unsharded_state_dict.get(fqn)):
                self._planned[fqn] = self._planned.get(fqn, 0) + int(torch.Size(item.lengths).numel())
        return dataclasses.replace(plan, items=items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return create_default_global_load_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # A stored item is data: tensors, containers, numbers, strings (more types through
        # torch.serialization.add_safe_globals); a pickle that would run code is refused.
        obj = torch.load(value, weights_only=True)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    def _stage_sharded(self, fqn: str) -> _Staging:
        t = self.sharded_state_dict[fqn]
        layout = local_layout(t.global_tensor)
        chunks = self._chunks[fqn]
        positions = [[p for p, r in enumerate(layout) if r[1] == c] for c in chunks]
        full = self._planned[fqn] == pieces_numel(layout, [ps[0] for ps in positions])
        current = {} if full else fetch_pieces(t.global_tensor, [ps[0] for ps in positions])
        buffers = []
        for c, ps in zip(chunks, positions):
            buf = torch.zeros(layout[ps[0]][3], dtype=t.dtype)
            if not full:
                narrow_tensor_by_index(buf, [0] * buf.dim(), chunk_of(c)[1]).copy_(current[ps[0]])
            buffers.append(buf)
        return _Staging(buffers, self._planned[fqn], positions)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        fqn = index.fqn
        if fqn in self.sharded_state_dict:
            if fqn not in self._staging:
                self._staging[fqn] = self._stage_sharded(fqn)
            chunk = self._chunks[fqn][index.index]
            if chunk_of(chunk)[0] != index.offset:
                raise RuntimeError(f"read item {index} does not match the local shard at that position")
            return self._staging[fqn].buffers[index.index]
        value = self.unsharded_state_dict[fqn]
        if is_xla_tensor(value):
            if fqn not in self._staging:
                full = self._planned[fqn] == value.numel()
                with device_lock:
                    buf = (torch.empty(value.shape, dtype=value.dtype) if full
                           else value.detach().cpu().clone())
                self._staging[fqn] = _Staging([buf], self._planned[fqn])
            return self._staging[fqn].buffers[0]
        return find_state_dict_object(self.unsharded_state_dict, index)

    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        return narrow_tensor_by_index(tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem,
                      tensor: torch.Tensor) -> None:  # noqa: ARG002 (LoadPlanner's; a view of the staged buffer)
        fqn = read_item.dest_index.fqn
        staging = self._staging.get(fqn)
        if staging is None:
            return
        staging.pending -= int(torch.Size(read_item.lengths).numel())
        if staging.pending < 0:
            raise RuntimeError(f"too many elements read for {fqn}")
        if staging.pending:
            return
        del self._staging[fqn]
        if fqn in self.sharded_state_dict:
            t = self.sharded_state_dict[fqn]
            layout = local_layout(t.global_tensor)
            data: List[Optional[torch.Tensor]] = [None] * len(layout)
            for buf, ps in zip(staging.buffers, staging.positions):
                for p in ps:
                    data[p] = buf
            shards = []
            for p, (dev, index, rep, padded) in enumerate(layout):
                buf = data[p] if data[p] is not None else torch.zeros(padded, dtype=t.dtype)
                shards.append(XLAShard(buf, list(index), f"xla:{dev.id}", rep))
            with device_lock:
                _load_shards_in_place(t.global_tensor, shards)
            self._loaded.append(t.global_tensor)
        else:
            with device_lock, torch.no_grad():
                self.unsharded_state_dict[fqn].copy_(staging.buffers[0])
            self._loaded.append(self.unsharded_state_dict[fqn])
        if len(self._loaded) == len(self._planned):
            # Every xla tensor is read: run the copies in one program (the state_dict's
            # tensors hold device data again, laid out as before).
            loaded, self._loaded = self._loaded, []
            sync_tensors(loaded)
