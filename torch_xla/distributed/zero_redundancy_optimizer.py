"""`ZeroRedundancyOptimizer` (ZeRO-1): each process keeps the optimizer state of 1/N of
every parameter.

The parameters stay whole on every process. `step()` reduce-scatters the gradients
(averaged over the replicas) into shards cut along dim 0 (padded to a multiple of N),
optionally clips them by their global norm, runs the wrapped optimizer on the shards,
and all-gathers the updated shards back into the parameters: all in the step's graph.
"""
from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Dict, Iterator, List, Optional, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

from .. import runtime as xr
from .._engine import comm as _coll

_WARNED = set()


def _no_effect(arg: str, why: str) -> None:
    """Warns once per process that `arg` changes nothing here."""
    if arg not in _WARNED:
        _WARNED.add(arg)
        warnings.warn(f"ZeroRedundancyOptimizer: {arg} has no effect here: {why}", UserWarning, stacklevel=4)

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer):
    """Wraps `optimizer_class(shards, **defaults)`; see the module docstring.

    optimizer_dtype: dtype of the shards and optimizer state (default float32);
    grad_clipping / max_norm: clip the shard gradients by their global norm (max_norm
    default 1.0); sharding_groups: shard within these replica groups."""

    def __init__(self, params: Iterator[torch.Tensor], optimizer_class: Type[Optimizer],
                 optimizer_dtype: Optional[torch.dtype] = None, grad_clipping: bool = True,
                 max_norm: Optional[float] = None, pin_layout: bool = True, sharding_groups: Optional[Any] = None,
                 grad_norm_groups: Optional[Any] = None, lazy_init: bool = False, bucket_cap_mb_all_gather: int = 0,
                 bucket_cap_mb_reduce_scatter: int = 0, use_grad_acc_hook: bool = False,
                 save_master_weights: bool = False, higher_cc_precision: bool = False, **defaults: Any):
        if not save_master_weights:
            logging.warning("Not saving master weights may have accuracy issues when resuming training!")
        super().__init__(params, defaults)
        self.global_world_size = xr.world_size()
        self.global_rank = xr.global_ordinal()
        self._sharding_groups = sharding_groups or [list(range(self.global_world_size))]
        self._grad_norm_groups = grad_norm_groups
        self.optimizer_class = optimizer_class
        self.defaults = defaults
        self.optimizer_dtype = optimizer_dtype or torch.float32
        self.grad_clipping = grad_clipping
        self.max_norm = 1.0 if max_norm is None else max_norm
        self.pin_layout = pin_layout
        if not pin_layout:
            _no_effect("pin_layout=False", "every replica runs the same compiled program, so the layouts of "
                       "a collective's operands agree everywhere")
        if use_grad_acc_hook:
            _no_effect("use_grad_acc_hook=True", "gradients are reduce-scattered from `.grad` at `step()`, "
                       "whatever accumulated them")
        self.bucket_cap_mb_all_gather = bucket_cap_mb_all_gather
        self.bucket_cap_mb_reduce_scatter = bucket_cap_mb_reduce_scatter
        self.save_master_weights = save_master_weights
        self.higher_cc_precision = higher_cc_precision
        self._grad_norm: Optional[torch.Tensor] = None
        self.inited = False
        if not lazy_init:
            self.init_zero()

    @property
    def sharding_groups(self):
        return self._sharding_groups

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        return self._grad_norm

    def init_zero(self) -> None:
        """Cuts the shards and builds the wrapped optimizer on them."""
        me = self.global_rank
        group = next((list(g) for g in self._sharding_groups if me in g), None)
        if group is None:
            raise ValueError(f"Current rank {me} is missing from the sharding_groups {self._sharding_groups}")
        self.local_world_size, self.local_rank = len(group), group.index(me)
        self._groups_arg = None if len(self._sharding_groups[0]) == self.global_world_size else self._sharding_groups
        groups = []
        for pg in self.param_groups:
            shards = []
            for p in pg["params"]:
                if p.device.type != "xla":
                    raise AssertionError("ZeroRedundancyOptimizer: parameters must be on the xla device")
                data = self._shard(p.detach()).to(self.optimizer_dtype)
                shards.append(nn.Parameter(data, requires_grad=p.requires_grad))
            g = copy.copy(pg)
            g["params"] = shards
            groups.append(g)
        self.base_optimizer = self.optimizer_class(groups, **self.defaults)
        self.inited = True

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            t = t.reshape(1)
        pad = (-t.size(0)) % self.local_world_size
        return F.pad(t, [0, 0] * (t.dim() - 1) + [0, pad]) if pad else t

    def _shard(self, t: torch.Tensor) -> torch.Tensor:
        return self._pad(t).chunk(self.local_world_size)[self.local_rank].clone()

    def _pairs(self):
        for pg, sg in zip(self.param_groups, self.base_optimizer.param_groups):
            for p, s in zip(pg["params"], sg["params"]):
                yield p, s

    def _sync_groups(self, src: List[Dict], dst: List[Dict]) -> None:
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        self._sync_groups(self.param_groups, self.base_optimizer.param_groups)
        for p, s in self._pairs():
            if p.grad is None:
                continue
            g = self._pad(p.grad)
            if self.higher_cc_precision:
                g = g.to(self.optimizer_dtype)
            r = _coll.reduce_scatter("sum", g, 1.0 / self.local_world_size, 0, self.local_world_size, self._groups_arg)
            s.grad = r.to(self.optimizer_dtype)

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> None:
        grads = [s.grad for _, s in self._pairs() if s.grad is not None]
        if not grads:
            return
        local = torch.stack([g.float().norm(norm_type) ** norm_type for g in grads]).sum()
        total = _coll.all_reduce("sum", local, groups=self._grad_norm_groups or self._groups_arg) ** (1.0 / norm_type)
        self._grad_norm = total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    @torch.no_grad()
    def step(self, closure=None, **kwargs: Any):
        """Reduce-scatters the gradients, steps the wrapped optimizer on the shards and
        all-gathers the parameters."""
        if not self.inited:
            raise AssertionError("must call init_zero() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_gradients()
        if self.grad_clipping:
            self._clip_grad_norm(self.max_norm)
        self.base_optimizer.step(**kwargs)
        self.base_optimizer.zero_grad(set_to_none=True)
        self.allgather_weights_and_update_full_parameter()
        self._sync_groups(self.base_optimizer.param_groups, self.param_groups)
        return loss

    @torch.no_grad()
    def allgather_weights_and_update_full_parameter(self) -> None:
        for p, s in self._pairs():
            if p.grad is None:
                continue
            full = _coll.all_gather(s.detach().to(p.dtype), 0, self._groups_arg)
            p.copy_(full[:p.numel()].view(p.shape) if p.dim() == 0 else full[:p.size(0)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["base_state"] = self.base_optimizer.state_dict()["state"]
        sd["shape_info"] = [[tuple(p.shape) for p in pg["params"]] for pg in self.param_groups]
        if self.save_master_weights:
            sd["sharded_master_weights"] = {i: s.detach() for i, (_, s) in enumerate(self._pairs())}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = copy.copy(state_dict)
        base_state = state_dict.pop("base_state")
        state_dict.pop("shape_info", None)
        masters = state_dict.pop("sharded_master_weights", None)
        super().load_state_dict(state_dict)
        self.init_zero()
        tmp = self.base_optimizer.state_dict()
        tmp["state"] = base_state
        tmp["param_groups"] = state_dict["param_groups"]
        self.base_optimizer.load_state_dict(tmp)
        if masters is not None:
            with torch.no_grad():
                for i, (_, s) in enumerate(self._pairs()):
                    s.copy_(masters[i])
