"""Fully sharded data parallelism over the processes of a job (ZeRO-2/3)."""
from .state_dict_utils import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts
from .utils import checkpoint_module
from .xla_fully_sharded_data_parallel import XlaFullyShardedDataParallel

__all__ = ["XlaFullyShardedDataParallel", "consolidate_sharded_state_dicts", "consolidate_sharded_model_checkpoints",
           "checkpoint_module"]
