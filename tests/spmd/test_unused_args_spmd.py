"""SPMD arguments that used to be ignored: `_XLAC._spmd_shard_to_full_shape`'s dtype."""
import numpy as np
import torch

import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


def test_shard_to_full_shape_gives_the_requested_dtype():
    n = xr.global_runtime_device_count()
    m = xs.Mesh(np.arange(n), (1, n))
    xs.set_global_mesh(m)
    t = torch.arange(8.0 * n).reshape(8, n)
    xx = xs.enable_manual_sharding(t.to("xla"), (None, 1))
    y = xs._mark_manual_sharding(torch.cumsum(xx.global_tensor, 0) * 2).global_tensor
    full = torch_xla._XLAC._spmd_shard_to_full_shape(y, m.get_op_sharding((None, 1)), (8, n), torch.bfloat16)
    assert full.dtype == torch.bfloat16
    assert torch_xla._XLAC._get_xla_sharding_spec(full) == f"{{devices=[1,{n}]{','.join(map(str, range(n)))}}}"
    torch.testing.assert_close(full.cpu(), (torch.cumsum(t, 0) * 2).to(torch.bfloat16))
