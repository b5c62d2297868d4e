"""SPMD inside `torch.compile(backend='openxla')`: `torch.ops.xla.dynamo_mark_sharding`,
`xs.mark_sharding` as an op of the compiled graph, sharded inputs and their layout changes."""
import numpy as np
import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch_xla.distributed.spmd import xla_sharding

spec_of = torch_xla._XLAC._get_xla_sharding_spec


def _mesh():
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n, 1), ("data", "model"))


def _op_args(mesh):
    return mesh.device_ids.tolist(), list(mesh.mesh_shape), str(mesh.axis_names)


def _rows(n):   # dimension 0 split over every device
    return f"{{devices=[{n},1]{','.join(map(str, range(n)))}}}"


def _cols(n):
    return f"{{devices=[1,{n}]{','.join(map(str, range(n)))}}}"


def _compile_count():
    return met.metric_data("CompileTime")[0] if "CompileTime" in met.metric_names() else 0


def test_dynamo_mark_sharding_eager_lays_the_tensor_out():
    mesh = _mesh()
    n = mesh.size()
    w = torch.randn(4 * n, 8)
    xw = w.to("xla")
    out = torch.ops.xla.dynamo_mark_sharding(xw, *_op_args(mesh), "('data', None)")
    assert spec_of(xw) == _rows(n)
    torch.testing.assert_close(xw.cpu(), w)
    torch.testing.assert_close(out.cpu(), w)


def test_dynamo_mark_sharding_spec_by_axis_index_and_unnamed_mesh():
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (1, n))
    w = torch.randn(8, 2 * n)
    xw = w.to("xla")
    torch.ops.xla.dynamo_mark_sharding(xw, mesh.device_ids.tolist(), [1, n], str(mesh.axis_names), "(0, 1)")
    assert spec_of(xw) == _cols(n)
    torch.testing.assert_close(xw.cpu(), w)


def test_dynamo_mark_sharding_errors():
    mesh = _mesh()
    xw = torch.randn(8, 8).to("xla")
    with pytest.raises(ValueError, match="partition_spec"):
        torch.ops.xla.dynamo_mark_sharding(xw, *_op_args(mesh), "('data', ")
    with pytest.raises(xla_sharding.ShardingError, match="Partition spec length"):
        torch.ops.xla.dynamo_mark_sharding(xw, *_op_args(mesh), "('data',)")


def test_dynamo_mark_sharding_on_cpu_is_a_copy():
    mesh = _mesh()
    t = torch.randn(8, 4)
    out = torch.ops.xla.dynamo_mark_sharding(t, *_op_args(mesh), "('data', None)")
    torch.testing.assert_close(out, t)
    assert out.data_ptr() != t.data_ptr()


def test_dynamo_mark_sharding_passes_the_gradient_through():
    mesh = _mesh()
    x = torch.randn(8, 4)
    xx = x.to("xla").requires_grad_()
    y = torch.ops.xla.dynamo_mark_sharding(xx * 3, *_op_args(mesh), "('data', None)")
    (y * y).sum().backward()
    cx = x.clone().requires_grad_()
    (torch.ops.xla.dynamo_mark_sharding(cx * 3, *_op_args(mesh), "('data', None)") ** 2).sum().backward()
    torch.testing.assert_close(xx.grad.cpu(), cx.grad)


def test_activation_sharding_inside_the_compiled_program():
    # The op's result is unused: the annotation applies to its input, and the graph keeps it.
    mesh = _mesh()
    n = mesh.size()
    ids, shape, names = _op_args(mesh)

    def fn(x, w):
        y = x @ w
        torch.ops.xla.dynamo_mark_sharding(y, ids, shape, names, "('data', None)")
        return y, y + 1

    x, w = torch.randn(4 * n, 16), torch.randn(16, 4)
    xx, xw = x.to("xla"), w.to("xla")
    compiled = torch.compile(fn, backend="openxla")
    for _ in range(2):   # the trace, then the cached program
        y, z = compiled(xx, xw)
        assert spec_of(y) == _rows(n)
        torch.testing.assert_close(y.cpu(), x @ w)
        torch.testing.assert_close(z.cpu(), x @ w + 1)
    assert spec_of(xx) == "" and spec_of(xw) == ""


def test_mark_sharding_is_an_op_of_the_compiled_graph():
    mesh = _mesh()
    n = mesh.size()

    def fn(x, w):
        y = torch.relu(x @ w)
        xs.mark_sharding(y, mesh, ("data", None))
        return y * 2

    x, w = torch.randn(4 * n, 16), torch.randn(16, 8)
    xx, xw = x.to("xla"), w.to("xla")
    # fullgraph: a graph break (mark_sharding run between two programs) would raise.
    compiled = torch.compile(fn, backend="openxla", fullgraph=True)
    out = compiled(xx, xw)
    assert spec_of(out) == _rows(n)
    torch.testing.assert_close(out.cpu(), torch.relu(x @ w) * 2)


def test_mark_sharding_of_a_graph_input_inside_the_compiled_function():
    # The input is laid out inside the program only: its data stays as it was, and each
    # run reads the input's current value (no stale captured copy).
    mesh = _mesh()
    n = mesh.size()

    def fn(x, w):
        xs.mark_sharding(x, mesh, ("data", None))
        return x @ w

    w = torch.randn(16, 8)
    xw = w.to("xla")
    compiled = torch.compile(fn, backend="openxla", fullgraph=True)
    for _ in range(2):
        x = torch.randn(4 * n, 16)
        xx = x.to("xla")
        out = compiled(xx, xw)
        torch.testing.assert_close(out.cpu(), x @ w)
        assert spec_of(out) == _rows(n)
        assert spec_of(xx) == ""
        torch.testing.assert_close(xx.cpu(), x)


def test_compiled_module_with_sharded_weights_matches_cpu():
    mesh = _mesh()
    n = mesh.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8 * n), torch.nn.ReLU(), torch.nn.Linear(8 * n, 4))
    x = torch.randn(2 * n, 16)
    with torch.no_grad():
        want = model(x)
    xmodel = model.to("xla")
    xs.mark_sharding(xmodel[0].weight, mesh, ("data", None))
    xs.mark_sharding(xmodel[2].weight, mesh, (None, "data"))
    compiled = torch.compile(xmodel, backend="openxla")
    with torch.no_grad():
        for _ in range(2):
            out = compiled(x.to("xla"))
            torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    assert spec_of(xmodel[0].weight) == _rows(n)
    assert spec_of(xmodel[2].weight) == _cols(n)


def test_a_change_of_input_sharding_gives_a_program_for_the_new_layout():
    mesh = _mesh()
    n = mesh.size()

    def fn(x):
        return torch.sin(x) * 2

    x, y = torch.randn(4 * n, 2 * n), torch.randn(4 * n, 2 * n)
    xx, xy = x.to("xla"), y.to("xla")
    torch_xla.sync()
    compiled = torch.compile(fn, backend="openxla")
    out = compiled(xx)
    torch.testing.assert_close(out.cpu(), torch.sin(x) * 2)
    assert spec_of(out) == ""
    before = _compile_count()

    xs.mark_sharding(xx, mesh, ("data", None))
    out = compiled(xx)
    torch.testing.assert_close(out.cpu(), torch.sin(x) * 2)
    assert spec_of(out) == _rows(n)   # the program of the sharded input
    assert _compile_count() == before + 1

    xs.mark_sharding(xy, mesh, (None, "data"))
    out = compiled(xy)
    torch.testing.assert_close(out.cpu(), torch.sin(y) * 2)
    assert spec_of(out) == _cols(n)
    assert _compile_count() == before + 2

    out = compiled(xx)   # a layout seen before: its program again, no compile
    torch.testing.assert_close(out.cpu(), torch.sin(x) * 2)
    assert spec_of(out) == _rows(n)
    assert _compile_count() == before + 2

    xs.clear_sharding(xx)   # back to replicated
    out = compiled(xx)
    torch.testing.assert_close(out.cpu(), torch.sin(x) * 2)
    assert _compile_count() == before + 2


def test_activation_sharding_in_a_compiled_training_step():
    mesh = _mesh()
    n = mesh.size()

    def fn(x, w):
        y = torch.tanh(x @ w)
        xs.mark_sharding(y, mesh, ("data", None))
        return (y * y).sum()

    x, w = torch.randn(2 * n, 16), torch.randn(16, 4, requires_grad=True)
    xw = w.detach().to("xla").requires_grad_()
    compiled = torch.compile(fn, backend="openxla", fullgraph=True)
    for _ in range(2):   # gradients accumulate over two steps, on both sides
        loss = compiled(x.to("xla"), xw)
        loss.backward()
        want = (torch.tanh(x @ w) ** 2).sum()
        want.backward()
        torch.testing.assert_close(loss.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xw.grad.cpu(), w.grad, rtol=1e-5, atol=1e-5)
