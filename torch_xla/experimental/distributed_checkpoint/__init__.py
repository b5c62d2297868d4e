"""Distributed checkpoints of SPMD programs with `torch.distributed.checkpoint`.

    import torch.distributed.checkpoint as dist_cp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner, SPMDLoadPlanner
    dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(path), planner=SPMDSavePlanner())
    dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(path), planner=SPMDLoadPlanner())

Sharded xla tensors are written piece by piece by the processes that hold them and read
back into the layout of the target state_dict; `CheckpointManager` keeps per-step
checkpoints (atomically written, optionally in the background).
"""
from .manager import CheckpointManager
from .planners import SPMDLoadPlanner, SPMDSavePlanner
from .util import prime_optimizer

__all__ = ["CheckpointManager", "SPMDSavePlanner", "SPMDLoadPlanner", "prime_optimizer"]
