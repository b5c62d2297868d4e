"""Names of the environment variables torch_xla and its launchers read (`xenv.PJRT_DEVICE`).

Each constant is the variable's name; values are read through `torch_xla._engine.config`."""
from .._engine import config as _config

_NAMES = (
    "PJRT_DEVICE", "PJRT_CPU_ASYNC_CLIENT", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES", "WORLD_SIZE", "RANK",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WORKER_ID", "ACCELERATOR_TYPE",
    "TPU_ACCELERATOR_TYPE", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT",
    "TPU_WORKER_ID", "TPU_SKIP_MDS_QUERY", "CLOUD_TPU_TASK_ID", "XLA_FLAGS", "XLA_USE_SPMD",
    "XLA_HLO_DEBUG", "XLA_IR_DEBUG", "XLA_USE_BF16", "XLA_NO_SPECIAL_SCALARS",
)
for _name in tuple(_NAMES) + tuple(_config.VARS):
    globals()[_name] = _name
del _name
