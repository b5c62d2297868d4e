"""torch.complex32 (chalf) on the xla device against eager PyTorch on the CPU: held as
complex64 on the device, rounded to float16 parts after each op, complex32 again on the host."""

import pytest
import torch

from helpers import XLA, no_fallback

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def same(dev_result, cpu_result):
    """Equal dtype, shape and bits (values compared through complex64: few CPU kernels
    take complex32)."""
    d = dev_result.cpu()
    assert d.device.type == "cpu"
    assert d.dtype == cpu_result.dtype and d.shape == cpu_result.shape, (d.dtype, d.shape, cpu_result.dtype)

    def wide(t):
        return t.to(torch.complex64) if t.dtype == torch.complex32 else t
    torch.testing.assert_close(wide(d), wide(cpu_result), rtol=0, atol=0, equal_nan=True)


def chalf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.complex64).chalf()


def test_transfer_round_trip():
    c = chalf(3, 5)
    d = c.to(XLA)
    assert d.dtype == torch.complex32 and d.device.type == "xla"
    same(d, c)
    same(d[1:, ::2], c[1:, ::2])
    assert d[2, 3].item() == c[2, 3].item()


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16,
                                 torch.int64, torch.bool])
def test_conversions_round_as_cpu(src):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 6, generator=g, dtype=torch.complex128) * 300).to(src) if src.is_complex else \
        (torch.randn(4, 6, generator=g, dtype=torch.float64) * 300).to(src)
    with no_fallback():
        y = x.to(XLA).chalf()
        same(y, x.chalf())
    same(y.to(torch.complex64), x.chalf().to(torch.complex64))
    same(y.to(torch.complex128), x.chalf().to(torch.complex128))


def test_arithmetic_rounds_each_result():
    a, b = chalf(4, 5), chalf(4, 5, seed=1)
    da, db = a.to(XLA), b.to(XLA)
    with no_fallback():
        same(da + db, a + b)
        same(da - db, a - b)
        same(da * db, a * b)
        same(da * 1.1, a * 1.1)
        same(da.add(db, alpha=3), a.add(b, alpha=3))
        same(-da, -a)
        same(da.conj().resolve_conj(), a.conj().resolve_conj())
        same(da * db * da + db, a * b * a + b)
        same(da == db, a == b)
        same(da.abs(), a.abs())
        same(da.real, a.real)
        same(da.imag, a.imag)
    # mixed with complex64: promoted, as on the CPU
    c = torch.randn(5, dtype=torch.complex64)
    same(da + c.to(XLA), a + c)


def test_in_place_and_factories():
    a = chalf(3, 4)
    d = a.to(XLA)
    d.add_(d)
    a.add_(a)
    same(d, a)
    same(torch.zeros(2, 3, dtype=torch.complex32, device=XLA), torch.zeros(2, 3, dtype=torch.complex32))
    same(torch.full((2,), 0.1 + 2j, dtype=torch.complex32, device=XLA), torch.full((2,), 0.1 + 2j, dtype=torch.complex32))
    d.fill_(1.7 - 0.3j)
    a.fill_(1.7 - 0.3j)
    same(d, a)


def test_shape_ops():
    a, b = chalf(2, 3), chalf(2, 3, seed=2)
    da, db = a.to(XLA), b.to(XLA)
    with no_fallback():
        same(torch.cat([da, db], 1), torch.cat([a, b], 1))
        same(torch.stack([da, db]), torch.stack([a, b]))
        same(da.t(), a.t())
        same(da.reshape(3, 2), a.reshape(3, 2))
        same(da.flip(0), a.flip(0))


def test_complex_views():
    a = chalf(3, 4)
    d = a.to(XLA)
    with no_fallback():
        same(torch.view_as_real(d), torch.view_as_real(a))
        h = torch.view_as_real(a)
        same(torch.view_as_complex(h.to(XLA)), torch.view_as_complex(h))


@pytest.mark.parametrize("to", [torch.float32, torch.int32, torch.float16, torch.int16, torch.uint8,
                                torch.float64, torch.complex64, torch.complex128])
def test_view_dtype(to):
    a = chalf(4, 4)
    d = a.to(XLA)
    with no_fallback():
        v = a.view(to)
        same(d.view(to), v)
        same(d.view(to).view(torch.complex32), v.view(torch.complex32))


def test_view_dtype_bool_and_complex64():
    """The same bitcasts for the dtypes XLA bitcasts not at all (bool, complex)."""
    b = torch.tensor([[True, False, True, True], [False, False, True, False]])
    same(b.to(XLA).view(torch.int16), b.view(torch.int16))
    same(b.view(torch.uint8).to(XLA).view(torch.bool), b)
    z = torch.randn(2, 4, dtype=torch.complex64)
    same(z.to(XLA).view(torch.float32), z.view(torch.float32))
    same(z.to(XLA).view(torch.complex32), z.view(torch.complex32))
    same(z.view(torch.int16).to(XLA).view(torch.complex64), z)
    same(z.to(XLA).view(torch.float64).view(torch.complex128), z.view(torch.complex128))


def test_view_dtype_0d():
    a = chalf(1)[0]
    same(a.to(XLA).view(torch.float32), a.view(torch.float32))
    f = torch.tensor(3.5)
    same(f.to(XLA).view(torch.complex32), f.view(torch.complex32))


def test_storage_type():
    import torch_xla
    assert torch_xla._XLAC._get_xla_tensor_shape_type(chalf(2).to(XLA)) == "c64"
