"""`torch_xla.backends.set_mat_mul_precision`: the setting, its warning, its effect on the
lowered matrix products and convolutions, and recompilation when it changes."""
from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F

import torch_xla
import torch_xla.backends as xb
import torch_xla.debug.metrics as met
from helpers import assert_same, to_xla

PRECISIONS = ("default", "high", "highest")


@pytest.fixture
def restore_precision():
    before = xb.get_mat_mul_precision()
    yield
    xb.set_mat_mul_precision(before)


def _hlo(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_tensors_hlo([t])


def _precision_attrs(hlo: str, op: str):
    return [re.search(r"operand_precision=\{[a-z,]+\}", line) for line in hlo.splitlines() if f" {op}(" in line]


def test_get_set_and_warning(restore_precision, caplog):
    assert xb.get_mat_mul_precision() == "highest"
    for p in PRECISIONS:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=xb.logger.name):
            xb.set_mat_mul_precision(p)
        assert xb.get_mat_mul_precision() == p
        assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
            (xb.logger.name, logging.WARNING, xb._WARNING_MESSAGE)]


def test_invalid_precision(restore_precision, caplog):
    xb.set_mat_mul_precision("high")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=xb.logger.name):
        with pytest.raises(ValueError, match="Invalid precision: medium"):
            xb.set_mat_mul_precision("medium")
    assert caplog.records == []   # refused before the warning, the setting unchanged
    assert xb.get_mat_mul_precision() == "high"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_values_match_cpu(precision, restore_precision):
    # The CPU computes float32 products in float32 whatever the setting.
    xb.set_mat_mul_precision(precision)
    torch.manual_seed(0)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    x, w = torch.randn(2, 3, 9, 9), torch.randn(5, 3, 3, 3)
    ba, bb = torch.randn(3, 4, 6), torch.randn(3, 6, 2)
    assert_same(to_xla(a) @ to_xla(b), a @ b)
    assert_same(torch.bmm(to_xla(ba), to_xla(bb)), torch.bmm(ba, bb))
    assert_same(F.linear(to_xla(a), to_xla(b.T)), F.linear(a, b.T))
    assert_same(F.conv2d(to_xla(x), to_xla(w), padding=1), F.conv2d(x, w, padding=1), rtol=1e-5, atol=1e-5)
    assert_same(F.conv_transpose2d(to_xla(x), to_xla(w.transpose(0, 1)), stride=2),
                F.conv_transpose2d(x, w.transpose(0, 1), stride=2), rtol=1e-5, atol=1e-5)
    for got, want in zip(torch._foreach_mm([to_xla(a)], [to_xla(b)]), torch._foreach_mm([a], [b])):
        assert_same(got, want)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hlo_shows_precision(precision, restore_precision):
    # XLA prints operand_precision unless it is DEFAULT, as in the original's HLO.
    xb.set_mat_mul_precision(precision)
    a, b = torch.randn(4, 4, device="xla"), torch.randn(4, 4, device="xla")
    x, w = torch.randn(1, 3, 8, 8, device="xla"), torch.randn(2, 3, 3, 3, device="xla")
    want = None if precision == "default" else f"operand_precision={{{precision},{precision}}}"
    for hlo, op in ((_hlo(a @ b), "dot"), (_hlo(F.conv2d(x, w)), "convolution")):
        found = _precision_attrs(hlo, op)
        assert found, hlo
        assert [m.group(0) if m else None for m in found] == [want] * len(found)


def test_change_recompiles(restore_precision):
    a, b = torch.randn(6, 6), torch.randn(6, 6)
    xa, xbb = to_xla(a), to_xla(b)

    def run():
        before = met.counter_value("UncachedCompile") or 0
        out = (xa @ xbb + 1).cpu()
        return out, (met.counter_value("UncachedCompile") or 0) - before

    xb.set_mat_mul_precision("high")
    out, _ = run()
    assert_same(out, a @ b + 1)
    assert run()[1] == 0                       # same setting: the cached program
    xb.set_mat_mul_precision("default")
    out, compiles = run()
    assert compiles == 1                       # new setting: compiled again
    assert_same(out, a @ b + 1)
