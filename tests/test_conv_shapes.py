"""The convolution's own shape rule (lowering/conv.py `conv_output_shape`): output and
gradient shapes and values as eager PyTorch on the CPU computes them, and for bad
arguments the CPU's exception type and message (float32, the CPU's oneDNN path)."""
import pytest
import torch
import torch.nn.functional as F

import torch_xla

R = torch.randn

BAD = {
    "wrong channels": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 2, 3, 3), None), {}),
    "kernel bigger than input": (F.conv2d, lambda: (R(2, 3, 4, 4), R(4, 3, 5, 5), None), {}),
    "dilated kernel bigger": (F.conv2d, lambda: (R(2, 3, 6, 6), R(4, 3, 3, 3), None), {"dilation": 3}),
    "1d kernel bigger": (F.conv1d, lambda: (R(2, 3, 2), R(4, 3, 3), None), {}),
    "stride 0": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"stride": 0}),
    "stride -1": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"stride": -1}),
    "padding -1": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"padding": -1}),
    "dilation 0": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"dilation": 0}),
    "dilation -1": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"dilation": -1}),
    "groups not dividing": (F.conv2d, lambda: (R(2, 4, 8, 8), R(6, 1, 3, 3), None), {"groups": 4}),
    "groups above out channels": (F.conv2d, lambda: (R(2, 4, 8, 8), R(2, 1, 3, 3), None), {"groups": 4}),
    "groups 0": (F.conv2d, lambda: (R(2, 4, 8, 8), R(2, 1, 3, 3), None), {"groups": 0}),
    "bias length": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), R(5)), {}),
    "bias 2-d": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), R(4, 1)), {}),
    "3-d weight": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3), None), {}),
    "padding list length": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"padding": (1, 1, 1)}),
    "stride list length": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None), {"stride": (1, 1, 1)}),
    "wrong channels, kernel bigger": (F.conv2d, lambda: (R(2, 5, 2, 2), R(4, 3, 3, 3), None), {}),
    "bias length, kernel bigger": (F.conv2d, lambda: (R(2, 3, 2, 2), R(4, 3, 3, 3), R(5)), {}),
    "negative dilation, stride 0": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None),
                                    {"dilation": -1, "stride": 0}),
    "groups 0, stride list length": (F.conv2d, lambda: (R(2, 3, 8, 8), R(4, 3, 3, 3), None),
                                     {"groups": 0, "stride": (1, 1, 1)}),
    "3d wrong channels": (F.conv3d, lambda: (R(2, 2, 5, 6, 7), R(4, 3, 2, 3, 2), None), {}),
    "transposed wrong channels": (F.conv_transpose2d, lambda: (R(2, 5, 5, 5), R(4, 3, 3, 3), None), {}),
    "transposed bias length": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), R(4)), {}),
    "transposed output padding": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), None),
                                  {"stride": 2, "output_padding": (1, 2)}),
    "transposed 1d output padding": (F.conv_transpose1d, lambda: (R(2, 4, 5), R(4, 3, 3), None),
                                     {"stride": 2, "output_padding": 2}),
    "transposed 3d output padding": (F.conv_transpose3d, lambda: (R(1, 4, 3, 3, 3), R(4, 3, 3, 3, 3), None),
                                     {"stride": 2, "output_padding": (2, 1, 1)}),
    "transposed negative output padding": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), None),
                                           {"stride": 2, "output_padding": -1}),
    "transposed negative padding": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), None),
                                    {"padding": -1}),
}


def _error(fn, args, kw, device):
    x, w, b = (None if t is None else t.to(device) for t in args)
    with pytest.raises(Exception) as info:
        fn(x, w, b, **kw)
    return info.value


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_raise_the_cpu_error(name):
    fn, make, kw = BAD[name]
    torch.manual_seed(0)
    args = make()
    cpu = _error(fn, args, kw, "cpu")
    xla = _error(fn, args, kw, torch_xla.device())
    assert type(xla) is type(cpu)
    assert str(xla) == str(cpu)


def test_transposed_output_too_small_is_the_cpu_kernels_error():
    # Float32 reaches oneDNN on the CPU, which words it as a descriptor failure; PyTorch's
    # own kernel (float64) words the check itself.
    x, w = R(2, 4, 1, 4, dtype=torch.float64), R(4, 3, 3, 3, dtype=torch.float64)
    cpu = _error(F.conv_transpose2d, (x, w, None), {"padding": 2}, "cpu")
    xla = _error(F.conv_transpose2d, (x, w, None), {"padding": 2}, torch_xla.device())
    assert (type(xla), str(xla)) == (type(cpu), str(cpu))
    assert "Output size is too small" in str(xla)


GOOD = {
    "zero input channels": (F.conv2d, lambda: (R(2, 0, 8, 8), R(4, 0, 3, 3), None), {}),
    "empty batch": (F.conv2d, lambda: (R(0, 3, 8, 8), R(4, 3, 3, 3), R(4)), {}),
    "kernel as large as the padded input": (F.conv2d, lambda: (R(2, 3, 3, 2), R(4, 3, 5, 4), None),
                                            {"padding": 1}),
    "1d strided dilated": (F.conv1d, lambda: (R(2, 3, 9), R(4, 3, 3), R(4)),
                           {"stride": 2, "padding": 1, "dilation": 2}),
    "3d mixed strides": (F.conv3d, lambda: (R(2, 3, 5, 6, 7), R(4, 3, 2, 3, 2), R(4)),
                         {"stride": (1, 2, 1), "padding": (0, 1, 1)}),
    "grouped": (F.conv2d, lambda: (R(2, 4, 8, 8), R(6, 2, 3, 3), R(6)), {"groups": 2, "stride": 2}),
    "unbatched": (F.conv2d, lambda: (R(3, 8, 8), R(4, 3, 3, 3), None), {}),
    "transposed": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), R(3)),
                   {"stride": 2, "output_padding": 1}),
    "transposed grouped": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), R(6)),
                           {"stride": 2, "groups": 2}),
    "transposed output padding below dilation": (F.conv_transpose2d, lambda: (R(2, 4, 5, 5), R(4, 3, 3, 3), None),
                                                 {"stride": 2, "dilation": 3, "output_padding": 2}),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_outputs_and_gradients_match_the_cpu(name):
    fn, make, kw = GOOD[name]
    torch.manual_seed(0)
    args = make()
    results = []
    for device in ("cpu", torch_xla.device()):
        ts = [None if t is None else t.detach().to(device).requires_grad_() for t in args]
        y = fn(*ts, **kw)
        (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).to(device)).sum().backward()
        results.append([y] + [t.grad for t in ts if t is not None])
    for c, x in zip(*results):
        assert x.shape == c.shape and x.dtype == c.dtype
        torch.testing.assert_close(x.cpu(), c, rtol=1e-4, atol=1e-4)
