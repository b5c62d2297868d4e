"""Consolidation of sharded FSDP checkpoints into the unwrapped model's state dict."""
from __future__ import annotations

import glob
import os
import re
import warnings
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["consolidate_sharded_state_dicts", "consolidate_sharded_model_checkpoints"]

_WRAPPED = "_fsdp_wrapped_module"


def _clean(name: str) -> str:
    """A wrapped model's name -> the unwrapped model's name."""
    return ".".join(p for p in name.split(".") if p != _WRAPPED)


def consolidate_sharded_state_dicts(state_dict_list: List[Dict[str, Any]],
                                    shard_metadata_list: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Builds the full state dict of the unwrapped model from every rank's
    `model.state_dict()` and `model.get_shard_metadata()` (one pair per rank)."""
    if len(state_dict_list) != len(shard_metadata_list) or not state_dict_list:
        raise ValueError("expected one shard metadata per state dict, and at least one")
    order = sorted(range(len(state_dict_list)), key=lambda i: shard_metadata_list[i]["rank"])
    sds = [state_dict_list[i] for i in order]
    meta = shard_metadata_list[order[0]]
    world = meta["world_size"]
    ranks = [shard_metadata_list[i]["rank"] for i in order]
    worlds = sorted({m["world_size"] for m in shard_metadata_list})
    if len(worlds) > 1:
        raise ValueError(f"the checkpoints come from jobs of different world sizes {worlds}")
    if ranks != list(range(world)):
        raise ValueError(f"expected one checkpoint for each rank 0..{world - 1} of a world size of {world}, "
                         f"got ranks {ranks}")
    full: Dict[str, torch.Tensor] = {}
    shard_keys = set()
    for prefix, shards in meta["shard_info"].items():
        base = _clean(prefix)
        for shard_name, info in shards.items():
            key = f"{prefix}.{shard_name}" if prefix else shard_name
            shard_keys.add(key)
            whole = torch.cat([sd[key].cpu() for sd in sds])
            sizes = [torch.Size(s) for s in info["_orig_sizes"]]
            if info["_dim0"]:
                values = [whole[:sizes[0][0]]]
            else:
                numels = [s.numel() for s in sizes]
                values = [t.view(s) for t, s in zip(whole[:sum(numels)].split(numels), sizes)]
            for name, v in zip(info["_orig_names"], values):
                full[f"{base}.{name}" if base else name] = v.clone()
    for key, v in sds[0].items():
        if key in shard_keys:
            continue
        dt = meta.get("buffer_info", {}).get(key, {}).get("_orig_dtype")
        if isinstance(v, torch.Tensor):
            v = v.cpu() if dt is None else v.cpu().to(dt)
        full[_clean(key)] = v
    return full


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth", save_path: str = "",
                                          save_model: bool = True) -> Tuple[Dict[str, torch.Tensor], str]:
    """Reads the files `ckpt_prefix + ckpt_suffix` (each a dict with "model" and
    "shard_metadata"), consolidates them and saves {"model": full} to `save_path`
    (default `ckpt_prefix + "_consolidated.pth"`). Returns (full state dict, path)."""
    paths = sorted(glob.glob(ckpt_prefix + ckpt_suffix))
    if not paths:
        raise FileNotFoundError(f"no checkpoint matches {ckpt_prefix + ckpt_suffix}")
    paths = [p for p in paths if not re.search(r"_consolidated\.pth$", p)]
    # the files are data (tensors, sizes, dtypes, names): a pickle that would run code is refused
    ckpts = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    by_world: Dict[int, List[int]] = {}
    for i, c in enumerate(ckpts):
        by_world.setdefault(c["shard_metadata"]["world_size"], []).append(i)
    if len(by_world) > 1:
        # Files of an earlier job with another world size match the pattern too (a script run
        # again with another number of processes, writing to the same place). The set to
        # consolidate is the one complete set written after every other file; the others are
        # named in a warning. Without such a set, which one is meant cannot be told.
        mtime = [os.path.getmtime(p) for p in paths]
        found = "; ".join(f"world size {w}: {', '.join(paths[i] for i in ix)}" for w, ix in sorted(by_world.items()))
        chosen = None
        for w, ix in by_world.items():
            complete = sorted(ckpts[i]["shard_metadata"]["rank"] for i in ix) == list(range(w))
            others = [mtime[j] for j in range(len(paths)) if j not in ix]
            if complete and min(mtime[i] for i in ix) > max(others):
                chosen = ix
        if chosen is None:
            raise ValueError(f"{ckpt_prefix + ckpt_suffix} matches checkpoints of different jobs ({found}); "
                             "remove the stale files or narrow ckpt_suffix")
        warnings.warn(f"{ckpt_prefix + ckpt_suffix} matches checkpoints of different jobs ({found}); "
                      f"consolidating the newest complete set ({', '.join(paths[i] for i in chosen)})")
        paths = [paths[i] for i in chosen]
        ckpts = [ckpts[i] for i in chosen]
    full = consolidate_sharded_state_dicts([c["model"] for c in ckpts], [c["shard_metadata"] for c in ckpts])
    save_path = save_path or ckpt_prefix + "_consolidated.pth"
    if save_model:
        from ...core.xla_model import atomic_save
        atomic_save({"model": full}, save_path)
    return full, save_path
