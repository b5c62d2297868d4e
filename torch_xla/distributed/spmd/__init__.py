"""SPMD: annotate tensors with a layout over a device mesh; XLA partitions the program.

    import torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (4, 2), ('data', 'model'))
    xs.mark_sharding(t, mesh, ('data', None))
"""
from .xla_sharded_tensor import XLAShard, XLAShardedTensor
from .xla_sharding import (HybridMesh, MarkShardingFunction, Mesh, OpSharding, ShardingSpec, ShardingType,
                           XLAPatchedLinear, _mark_manual_sharding, annotate_custom_sharding, apply_backward_optimization_barrier,
                           disable_manual_sharding, enable_manual_sharding,
                           apply_xla_patch_to_nn_linear, clear_sharding, get_1d_mesh, get_global_mesh, mark_sharding,
                           mark_sharding_with_gradients, set_global_mesh, shard_as, unwrap_sharded_tensor,
                           wrap_as_sharded_tensor, wrap_if_sharded, xla_patched_nn_linear_forward)
from .api import auto_policy, convert_to_xla_mesh, xla_distribute_module, xla_distribute_tensor
from .debugging import visualize_sharding, visualize_tensor_sharding

__all__ = [
    "XLAShard", "XLAShardedTensor", "Mesh", "HybridMesh", "ShardingType", "ShardingSpec", "OpSharding",
    "XLAPatchedLinear", "MarkShardingFunction", "mark_sharding", "mark_sharding_with_gradients",
    "shard_as", "annotate_custom_sharding", "clear_sharding", "get_1d_mesh", "wrap_if_sharded",
    "wrap_as_sharded_tensor", "unwrap_sharded_tensor", "xla_distribute_tensor", "xla_distribute_module",
    "auto_policy", "convert_to_xla_mesh", "xla_patched_nn_linear_forward", "apply_xla_patch_to_nn_linear",
    "set_global_mesh", "get_global_mesh", "apply_backward_optimization_barrier",
    "_mark_manual_sharding", "enable_manual_sharding", "disable_manual_sharding", "visualize_sharding", "visualize_tensor_sharding",
]
