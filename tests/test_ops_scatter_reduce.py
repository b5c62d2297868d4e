"""The reductions that scatter_reduce, index_reduce and scatter(reduce=...) share
(`lowering/indexing._reduce_at`): bool inputs and the refusals, against the CPU."""
from __future__ import annotations

import pytest
import torch

from helpers import XLA, check_op

_B = torch.tensor([True, False, False, True])
_IDX = torch.tensor([1, 1, 2, 0])
_SRC = torch.tensor([True, True, False, False])


@pytest.mark.parametrize("reduce", ["sum", "prod", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_bool(reduce, include_self):
    # sum / prod of bools are logical or / and, as on the CPU
    check_op(lambda x, i, s: x.scatter_reduce(0, i, s, reduce, include_self=include_self), _B, _IDX, _SRC)


@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_legacy_reduce_bool(reduce):
    check_op(lambda x, i, s: x.scatter(0, i, s, reduce=reduce), _B, _IDX, _SRC)


def test_scatter_reduce_bool_mean_refused():
    with pytest.raises(NotImplementedError, match="not implemented for 'Bool'"):
        _B.scatter_reduce(0, _IDX, _SRC, "mean")
    # the device refuses it when the op is recorded, with the CPU's message
    with pytest.raises(RuntimeError, match="not implemented for 'Bool'"):
        _B.to(XLA).scatter_reduce(0, _IDX.to(XLA), _SRC.to(XLA), "mean")


@pytest.mark.parametrize("reduce", ["sum", "foo"])
def test_index_reduce_unknown_reduce(reduce):
    x, idx, src = torch.zeros(3, 2), torch.tensor([0, 2]), torch.ones(2, 2)
    msg = f"Expected reduce to be one of prod, mean, amax or amin but got {reduce}"
    with pytest.raises(RuntimeError, match=msg):
        x.index_reduce(0, idx, src, reduce)
    # raised at the call, before any barrier
    with pytest.raises(RuntimeError, match=msg):
        x.to(XLA).index_reduce(0, idx.to(XLA), src.to(XLA), reduce)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce_int_without_self(reduce):
    x = torch.arange(12).reshape(3, 4)
    src = torch.arange(9).reshape(3, 3) - 4
    check_op(lambda a, s: a.index_reduce(1, torch.tensor([0, 2, 0], device=a.device), s, reduce, include_self=False),
             x, src)
