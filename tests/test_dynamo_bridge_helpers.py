"""The `torch_xla._XLAC` helpers the original's dynamo bridge is built on: graph hash,
graph inputs, warm-up and run of a cached graph, output counts with in-place updates,
pending IR, the base seed, and the graph dump of compiled programs. Values against
eager PyTorch on CPU."""
from __future__ import annotations

import pytest
import torch

import torch_xla
import torch_xla._XLAC as X
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla._engine import env_vars
from torch_xla._engine.executor import dumps
from helpers import XLA, assert_same


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 6, 1), torch.nn.ReLU(), torch.nn.Conv2d(6, 3, 1), torch.nn.ReLU())


def test_run_cached_graph_inputs_in_graph_input_order():
    cpu = _model()
    dev = _model().to(XLA)
    x = torch.randn(2, 4, 5, 5)
    torch_xla.sync()
    out = dev(x.to(XLA))
    key = X._get_graph_hash([out])
    ids, values = X._get_tensors_xla_device_data_node([out])
    # The original's parameter sequence: operands last to first, depth first.
    params = list(dev.parameters())
    expected = [X._xla_get_tensor_id(t) for t in reversed(params)]
    assert ids[:-1] == expected and len(ids) == len(params) + 1
    X._xla_warm_up_cache([out], [])
    assert_same(out, cpu(x))

    # New values in the same order (the last input is the image), on the device and on the CPU.
    torch.manual_seed(1)
    other = _model()
    x2 = torch.randn(2, 4, 5, 5)
    inputs = [p.detach() for p in reversed(list(other.parameters()))] + [x2]
    met.clear_all()
    for given in ([t.to(XLA) for t in inputs], inputs):
        res = X._run_cached_graph(key, given)
        assert len(res) == 1
        assert_same(res[0], other(x2))
    assert met.metric_data("CompileTime") is None   # compiled by the warm-up
    assert "RunCachedGraphInputData" in met.metric_names()
    assert "RunCachedGraphOutputData" in met.metric_names()


@pytest.mark.parametrize("inplace,dup,n_out", [(False, False, 2), (True, False, 3), (True, True, 3)])
def test_run_cached_graph_output_count(inplace, dup, n_out):
    """Inputs returned unchanged are not outputs of the graph; one written in place is,
    once however often it is returned."""
    def fn(a, b, c):
        if inplace:
            b.zero_()
        out = (a + b, a + c, b)
        return out + (b,) if dup else out

    args = [torch.randn(3) for _ in range(3)]
    xargs = [a.to(XLA) for a in args]
    torch_xla.sync()
    new = [torch.randn(3) for _ in range(3)]
    # Ids of the inputs' values before the call writes one of them.
    by_id = {X._xla_get_tensor_id(t): n for t, n in zip(xargs, new)}
    outs = fn(*xargs)
    key = X._get_graph_hash(list(outs))
    ids, values = X._get_tensors_xla_device_data_node(list(outs))
    X._xla_warm_up_cache(list(outs), [])
    res = X._run_cached_graph(key, [by_id[i].to(XLA) for i in ids])
    assert len(res) == n_out
    want = fn(*[n.clone() for n in new])
    assert_same(res[0], want[0])
    assert_same(res[1], want[1])
    if inplace:
        assert_same(res[2], want[2])


def test_run_cached_graph_errors():
    with pytest.raises(RuntimeError, match="no graph was warmed up"):
        X._run_cached_graph(b"\x01" * 8, [])
    a = torch.randn(4).to(XLA)
    torch_xla.sync()
    out = a * 2
    key = X._get_graph_hash([out])
    X._xla_warm_up_cache([out], [])
    with pytest.raises(RuntimeError, match="takes 1 inputs, got 2"):
        X._run_cached_graph(key, [a, a])


def test_uncloned_tensors_given_back():
    a = torch.randn(4).to(XLA)
    b = torch.randn(4).to(XLA)
    torch_xla.sync()
    out = a * b
    ids, values = X._get_tensors_xla_device_data_node([out], [a])
    assert values[ids.index(X._xla_get_tensor_id(a))] is a
    assert_same(values[ids.index(X._xla_get_tensor_id(b))], b)


def test_check_tensor_need_materialization():
    t = torch.randn(5)
    assert X._check_tensor_need_materialization([t]) == [False]
    xt = t.to(XLA)
    torch_xla.sync()
    assert X._check_tensor_need_materialization([xt]) == [False]
    y = xt * 2
    assert X._check_tensor_need_materialization([xt, y]) == [False, True]
    xt.mul_(3)
    assert X._check_tensor_need_materialization([xt]) == [True]
    assert_same(xt, t * 3)


def test_clear_pending_irs():
    torch_xla.sync()
    a = torch.randn(4, 3)
    b = torch.randn(4, 3)
    xa, xb = a.to(XLA), b.to(XLA)
    s = xa + xb
    p = s * xb
    met.clear_all()
    X._xla_sync_multi([p], devices=[], wait=True)
    assert_same(p, (a + b) * b)
    assert "aten::add" in X._get_xla_tensors_text([s])
    X._clear_pending_irs(str(XLA))
    assert "aten::add" not in X._get_xla_tensors_text([s])
    torch_xla.sync()
    assert met.metric_data("ExecuteTime")[0] == 1
    with pytest.raises(RuntimeError, match="placeholder"):
        s.cpu()


def test_seed_helpers():
    assert X._get_seed_info_id() == -127389
    xm.set_rng_state(23, str(XLA))
    seed = X._get_base_seed_as_tensor(str(XLA))
    assert seed.device.type == "xla" and seed.dtype == torch.int64
    assert seed.item() == 23


def test_graph_dump_of_compiled_runs(tmp_path, monkeypatch):
    """XLA_SAVE_TENSORS_FILE: every run of a compiled program appends its graph under
    `[dynamo]`, the graph hash five lines from the end as in the original's files."""
    torch._dynamo.reset()
    path = tmp_path / "graphs.txt"
    monkeypatch.setattr(dumps.settings, "on", True)

    def fn(x, y):
        return torch.cos(x) + torch.sin(y)

    compiled = torch.compile(fn, backend="openxla")
    x, y = torch.tensor(100.0), torch.tensor(200.0)
    with env_vars.overlay({"XLA_SAVE_TENSORS_FILE": str(path), "XLA_SAVE_TENSORS_FMT": "text"}):
        saved = dumps.saved_tensors_path()
        assert_same(compiled(x.to(XLA), y.to(XLA)), fn(x, y))
        first = open(saved).readlines()
        assert_same(compiled(x.to(XLA), y.to(XLA)), fn(x, y))
        second = open(saved).readlines()
    torch._dynamo.reset()
    assert "[dynamo]\n" in first
    assert "Graph Hash:" in first[-5]
    assert "Graph Hash:" in second[-5]
    assert len(second) > len(first)
    assert "aten::cos" in "".join(first)
