"""`xla_builder.FlattenedInputFunc`, `XlaCallable` (a function of builder ops called on
xla tensors) and `create_placeholder_tensor` (device data without a buffer), compared with
the same math in eager PyTorch on the CPU."""
import pytest
import torch

import torch_xla
import torch_xla.debug.metrics as met
from torch_xla.core import xla_builder as xb

X = torch_xla._XLAC


def test_flattened_input_func_round_trip():
    def f(d, items, scale=1):
        return {"sum": (d["a"]["b"] + items[2][1]) * scale, "first": items[0]}

    flat = xb.FlattenedInputFunc(f)
    t = torch.arange(4.0)
    args, kwargs = ({"a": {"b": t}}, [5, 6, [7, t * 2]]), {"scale": 3}
    tensors = flat.preprocess(args, kwargs)
    assert len(tensors) == 2 and all(isinstance(v, torch.Tensor) for v in tensors)
    out = flat.postprocess(flat.flat_call(tensors))
    expected = f(*args, **kwargs)
    assert out.keys() == expected.keys() and out["first"] == 5
    torch.testing.assert_close(out["sum"], expected["sum"])
    # new tensors in the same places, the other leaves as recorded by preprocess
    other = [torch.ones(4), torch.full((4,), 2.0)]
    torch.testing.assert_close(flat.postprocess(flat.flat_call(other))["sum"], (other[0] + other[1]) * 3)


def test_flattened_input_func_needs_preprocess_first():
    flat = xb.FlattenedInputFunc(lambda x: x)
    with pytest.raises(RuntimeError):
        flat.flat_call([])
    with pytest.raises(RuntimeError):
        flat.postprocess([])


def test_xla_callable_matches_torch(dev):
    def f(a, b):
        return xb.Op.sin(a) + b

    fn = xb.XlaCallable(f)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    res = fn(a.to(dev), b.to(dev))
    assert res.device.type == "xla"
    torch.testing.assert_close(res.cpu(), torch.sin(a) + b)


def test_xla_callable_structures_and_cache(dev):
    def f(pair, k):
        x, y = pair
        return {"prod": x * y, "neg": -x if k == "neg" else x}

    fn = xb.XlaCallable(f)
    for shape in ((2, 3), (2, 3), (5,)):
        x, y = torch.randn(shape), torch.randn(shape)
        out = fn((x.to(dev), y.to(dev)), "neg")
        torch.testing.assert_close(out["prod"].cpu(), x * y)
        torch.testing.assert_close(out["neg"].cpu(), -x)
    assert len(fn._cache) == 2     # one specialisation per shape
    out = fn((x.to(dev), y.to(dev)), "keep")
    torch.testing.assert_close(out["neg"].cpu(), x)
    assert len(fn._cache) == 3


def test_xla_callable_dtypes(dev):
    fn = xb.XlaCallable(lambda a, b: a * b + a)
    a, b = torch.randint(-5, 5, (4,), dtype=torch.int32), torch.randint(-5, 5, (4,), dtype=torch.int32)
    out = fn(a.to(dev), b.to(dev))
    assert out.dtype == torch.int32
    torch.testing.assert_close(out.cpu(), a * b + a)


@pytest.mark.parametrize("shape,dtype", [((1, 2), torch.float32), ((2, 3, 4), torch.bfloat16),
                                         ((3, 4, 5, 6), torch.int8)])
def test_placeholder_tensor(shape, dtype):
    p = xb.create_placeholder_tensor(shape, dtype)
    assert p.device == torch_xla.device()
    assert p.dtype == dtype and p.shape == shape
    assert X._is_placecholder(p)
    with pytest.raises(RuntimeError):
        p.cpu()


def test_placeholder_graph_is_printable_without_transfers(dev):
    met.clear_all()
    p1 = xb.create_placeholder_tensor((2, 3), torch.bfloat16)
    p2 = xb.create_placeholder_tensor((3, 4), torch.bfloat16)
    b = (torch.sin(p1) @ p2) @ p2.T
    text = X._get_xla_tensors_text([b])
    assert text.count("xla::device_data()") == 2
    hlo = X._get_xla_tensors_hlo([b])
    assert hlo.count("parameter(") == 2 and "bf16[2,3]" in hlo
    assert not met.metric_data("TransferToDeviceTime")
    # Running the graph fails at the placeholder (jax refuses it as an argument).
    with pytest.raises((RuntimeError, TypeError), match="no device buffer"):
        b.cpu()


def test_placeholder_handles_unique():
    p1 = xb.create_placeholder_tensor((1,), torch.bfloat16)
    p2 = xb.create_placeholder_tensor((1,), torch.bfloat16)
    h1, h2 = X._get_tensors_handle([p1, p2])
    assert h1 != h2


def test_handles_follow_buffers(dev):
    x = torch.randn(3).to(dev)
    y = x.clone()                  # same value, same buffer
    z = torch.randn(3).to(dev)
    hx, hy, hz = X._get_tensors_handle([x, y, z])
    assert hx == hy and hx != hz
    with pytest.raises(RuntimeError):
        X._get_tensors_handle([x + 1])   # pending: no buffer yet
