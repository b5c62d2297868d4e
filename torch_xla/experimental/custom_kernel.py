"""`torch_xla.experimental.custom_kernel`: kernel helpers.

Only the helpers written with tensor ops live here (they run on every device); the
Pallas kernels need a TPU or GPU Pallas toolchain and are not provided.
"""
from __future__ import annotations

import torch

__all__ = ["repeat_with_fixed_output_size"]


def repeat_with_fixed_output_size(input: torch.Tensor, repeats: torch.Tensor,
                                  total_repeat_length: int) -> torch.Tensor:
    """`torch.repeat_interleave(input, repeats)` with a length known before the run:
    cut to `total_repeat_length`, or padded with `input`'s last element.

    Output position j takes the element whose run of repeats covers j (the first whose
    cumulative repeat count exceeds j), so the graph has no data-dependent shape.
    """
    if input.dim() != 1 or repeats.dim() != 1:
        raise ValueError(f"repeat_with_fixed_output_size takes 1-d input and repeats, got "
                         f"{input.dim()}-d and {repeats.dim()}-d")
    ends = torch.cumsum(repeats, 0)
    pos = torch.arange(total_repeat_length, dtype=ends.dtype, device=input.device)
    idx = torch.searchsorted(ends, pos, right=True).clamp(max=input.numel() - 1)
    return input[idx]
