"""Collectives across replicas (processes).

With one replica every collective is the identity (times `scale`); the
multi-process forms are built from XLA collectives over the job's global mesh.
"""
from __future__ import annotations

from typing import Callable, List

import torch

from . import process_group

_REDUCE_TYPES = ("sum", "mul", "and", "or", "min", "max")


def _check_reduce_type(reduce_type: str) -> None:
    if reduce_type not in _REDUCE_TYPES:
        raise ValueError(f"invalid reduce type {reduce_type!r}; expected one of {_REDUCE_TYPES}")


def _multi(name: str):
    raise RuntimeError(
        f"{name} across {process_group.world_size()} processes is not available in this build: "
        f"multi-process collectives are not implemented yet")


def all_reduce(reduce_type, inputs, scale=1.0, groups=None):
    _check_reduce_type(reduce_type)
    if process_group.world_size() > 1:
        _multi("all_reduce")
    if isinstance(inputs, torch.Tensor):
        return inputs * scale if scale != 1.0 else inputs.clone()
    if scale != 1.0:
        with torch.no_grad():
            for t in inputs:
                t.mul_(scale)
    return inputs


def all_gather(value, dim=0, groups=None, output=None):
    if process_group.world_size() > 1:
        _multi("all_gather")
    if output is not None:
        with torch.no_grad():
            output.copy_(value)
        return output
    return value.clone()


def reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None):
    _check_reduce_type(reduce_type)
    if process_group.world_size() > 1:
        _multi("reduce_scatter")
    if shard_count != 1:
        raise ValueError(f"reduce_scatter: shard_count {shard_count} must equal the world size 1")
    inputs = input if isinstance(input, (list, tuple)) else [input]
    res = [t * scale for t in inputs]
    if output is not None:
        outs = output if isinstance(output, (list, tuple)) else [output]
        with torch.no_grad():
            for o, r in zip(outs, res):
                o.copy_(r)
        return output
    return res if isinstance(input, (list, tuple)) else res[0]


def all_to_all(value, split_dimension, concat_dimension, split_count, groups=None):
    if process_group.world_size() > 1:
        _multi("all_to_all")
    if split_count != 1:
        raise ValueError(f"all_to_all: split_count {split_count} must equal the world size 1")
    return value.clone()


def collective_permute(value, pairs):
    if process_group.world_size() > 1:
        _multi("collective_permute")
    if any(s == 0 and t == 0 for s, t in pairs):
        return value.clone()
    return torch.zeros_like(value)


def rendezvous(tag: str, payload: bytes = b"", replicas=()) -> List[bytes]:
    if process_group.world_size() > 1:
        _multi("rendezvous")
    return [payload]


def mesh_reduce(tag: str, data, reduce_fn: Callable):
    if process_group.world_size() > 1:
        _multi("mesh_reduce")
    return reduce_fn([data])


def broadcast_master_param(model: torch.nn.Module) -> None:
    if process_group.world_size() > 1:
        _multi("broadcast_master_param")
