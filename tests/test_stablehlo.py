"""torch_xla.stablehlo: exported programs against eager CPU, saved exports run by plain jax."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.stablehlo import (StableHLOExportOptions, StableHLOGraphModule, exported_program_to_stablehlo,
                                 save_as_stablehlo)
from helpers import XLA, assert_same
from models import MNIST, Decoder


def _mnist():
    torch.manual_seed(0)
    m = MNIST().eval()
    x = torch.randn(4, 1, 28, 28)
    return m, x


def test_export_mnist_matches_cpu_on_xla_and_cpu_inputs():
    m, x = _mnist()
    shlo = exported_program_to_stablehlo(torch.export.export(m, (x,)))
    ref = m(x)
    assert_same(shlo(x.to(XLA)), ref, rtol=1e-5, atol=1e-5)
    assert_same(shlo(x), ref, rtol=1e-5, atol=1e-5)
    x2 = torch.randn(4, 1, 28, 28)
    assert_same(shlo(x2), m(x2), rtol=1e-5, atol=1e-5)
    text = shlo.get_stablehlo_text("forward")
    assert text.count("stablehlo.convolution") == 2
    assert shlo.get_stablehlo_bytecode()[:4] == b"ML\xefR"
    with pytest.raises(ValueError, match="exported for"):
        shlo(torch.randn(5, 1, 28, 28))


def test_export_decoder_with_dict_outputs_and_kwargs():
    torch.manual_seed(0)
    dec = Decoder(n_layers=1).eval()

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dec = dec

        def forward(self, idx, *, scale):
            logits = self.dec(idx)
            return {"logits": logits * scale, "top": logits.argmax(-1)}

    idx = torch.randint(0, 128, (2, 16))
    scale = torch.tensor(0.5)
    ep = torch.export.export(Wrap(), (idx,), {"scale": scale})
    out = exported_program_to_stablehlo(ep)(idx, scale=scale)
    ref = Wrap()(idx, scale=scale)
    assert set(out) == {"logits", "top"}
    assert_same(out["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
    assert_same(out["top"], ref["top"])


def test_scalars_inlined_or_arguments():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.sub(torch.ops.aten.sub(x, 5), 1)

    x = torch.randn(3, 3)
    ep = torch.export.export(M(), (x,))
    inl = exported_program_to_stablehlo(ep)
    assert "dense<5.000000e+00>" in inl.get_stablehlo_text()
    opts = StableHLOExportOptions(inline_all_constant=False)
    arg = exported_program_to_stablehlo(ep, opts)
    text = arg.get_stablehlo_text()
    assert "dense<5.000000e+00>" not in text and "dense<1.000000e+00>" in text
    for shlo in (inl, arg):
        assert_same(shlo(x), x - 5 - 1)


def test_save_load_and_save_helpers(tmp_path):
    m, x = _mnist()
    ep = torch.export.export(m, (x,))
    save_as_stablehlo(ep, tmp_path / "a")
    loaded = StableHLOGraphModule.load(tmp_path / "a")
    assert_same(loaded(x), m(x), rtol=1e-5, atol=1e-5)
    assert set(loaded._bundle.state_dict) == set(m.state_dict())
    torch_xla.save_torch_model_as_stablehlo(m, (x,), tmp_path / "b",
                                            StableHLOExportOptions(save_weights=False))
    assert not (tmp_path / "b" / "data").exists()
    bare = StableHLOGraphModule.load(tmp_path / "b")
    assert bare._bundle.state_dict == {}
    with pytest.raises(ValueError, match="missing"):
        bare(x)


_JAX_ONLY = r"""
import json, sys
import numpy as np
import jax
jax.config.update("jax_enable_x64", True)     # the program keeps PyTorch's 64-bit dtypes
from jax import export
path, x_file, out_file = sys.argv[1:]
meta = json.load(open(path + "/meta.json"))["methods"]["forward"]
exp = export.deserialize(bytearray(open(path + "/functions/forward.jaxexport", "rb").read()))
weights = np.load(path + "/data/weights.npz")
args = [weights[n] for n in meta["weights"]] + [np.load(x_file)]
args = [np.asarray(a).astype(aval.dtype) for a, aval in zip(args, exp.in_avals)]
out = exp.call(*args)
assert "torch" not in sys.modules and "torch_xla" not in sys.modules
np.save(out_file, np.asarray(out[0]))
"""


@pytest.mark.parametrize("dynamic", [False, True])
def test_saved_export_runs_on_plain_jax_without_torch(tmp_path, dynamic):
    m, x = _mnist()
    if dynamic:   # a symbolic batch: plain jax runs it at a batch size never traced
        ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))
        save_as_stablehlo(ep, tmp_path / "export")
    else:
        torch_xla.save_torch_model_as_stablehlo(m, (x,), tmp_path / "export")
    x2 = torch.randn(11 if dynamic else 4, 1, 28, 28)
    np.save(tmp_path / "x.npy", x2.numpy())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    res = subprocess.run([sys.executable, "-c", _JAX_ONLY, str(tmp_path / "export"), str(tmp_path / "x.npy"),
                          str(tmp_path / "out.npy")], capture_output=True, text=True, timeout=120, env=env,
                         cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "out.npy")), m(x2).detach(),
                               rtol=1e-5, atol=1e-5)
    meta = json.loads((tmp_path / "export" / "meta.json").read_text())
    batch = meta["methods"]["forward"]["inputs"][0][0][0]
    assert meta["methods"]["forward"]["inputs"] == [[[batch, 1, 28, 28], "float32"]]
    assert isinstance(batch, str) if dynamic else batch == 4


def test_dynamic_batch_exported_as_symbolic_and_runs_at_other_sizes(tmp_path):
    m, x = _mnist()
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},))
    shlo = exported_program_to_stablehlo(ep)
    main = next(line for line in shlo.get_stablehlo_text().splitlines() if "func.func public @main" in line)
    assert "tensor<?x1x28x28xf32>" in main and "-> (tensor<?x10xf32>" in main
    for b in (2, 7, 4):
        xb = torch.randn(b, 1, 28, 28)
        assert_same(shlo(xb), m(xb), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exported for"):
        shlo(torch.randn(3, 1, 28, 27))
    shlo.save(tmp_path / "d")
    loaded = StableHLOGraphModule.load(tmp_path / "d")
    xb = torch.randn(9, 1, 28, 28)
    assert_same(loaded(xb), m(xb), rtol=1e-5, atol=1e-5)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())["methods"]["forward"]
    assert meta["inputs"][0][0][1:] == [1, 28, 28] and isinstance(meta["inputs"][0][0][0], str)


def test_decoder_with_dynamic_batch_and_sequence_matches_cpu():
    torch.manual_seed(0)
    dec = Decoder(n_layers=1).eval()
    idx = torch.randint(0, 128, (2, 16))
    dims = {0: torch.export.Dim("batch", max=32), 1: torch.export.Dim("seq", max=32)}
    shlo = exported_program_to_stablehlo(torch.export.export(dec, (idx,), dynamic_shapes=(dims,)))
    for b, t in ((1, 5), (3, 16), (2, 31)):   # B*T and T*T sizes inside the graph follow both
        i = torch.randint(0, 128, (b, t))
        assert_same(shlo(i), dec(i), rtol=1e-4, atol=1e-5)


def test_derived_dim_exported_and_what_cannot_be_refused_clearly():
    class Half(torch.nn.Module):
        def forward(self, x):
            return x[: x.shape[0] // 2] * 2

    b = torch.export.Dim("b", min=1, max=32)
    ep = torch.export.export(Half(), (torch.randn(6, 3),), dynamic_shapes=({0: 2 * b},))
    shlo = exported_program_to_stablehlo(ep)      # the input's size is 2*b: the slice ends at b
    for n in (4, 10, 6):
        x = torch.randn(n, 3)
        assert_same(shlo(x), Half()(x))

    class Diag(torch.nn.Module):
        def forward(self, x):   # the diagonal's length is min(B, 5): not expressible here
            return torch.diagonal(x) * 2

    ep = torch.export.export(Diag(), (torch.randn(6, 5),), dynamic_shapes=({0: torch.export.Dim("b", min=3)},))
    with pytest.raises(ValueError, match="aten::diagonal_copy cannot be lowered with dynamic dimensions"):
        exported_program_to_stablehlo(ep)


def test_dynamic_batch_through_reductions_and_slices_matches_cpu():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.mean(0) + x.var(0) + x[1:].sum(0) - x[-2:].std() + x.cumsum(0)[-1] + x.sort(0)[0][0]

    x = torch.randn(6, 5)
    ep = torch.export.export(M(), (x,), dynamic_shapes=({0: torch.export.Dim("b", min=3, max=64)},))
    shlo = exported_program_to_stablehlo(ep)
    for b in (3, 9, 6):
        xb = torch.randn(b, 5)
        assert_same(shlo(xb), M()(xb), rtol=1e-5, atol=1e-5)


def test_xm_get_stablehlo_of_pending_tensors():
    m, x = _mnist()
    dm = MNIST().eval()
    dm.load_state_dict(m.state_dict())
    dm = dm.to(XLA)
    out = dm(x.to(XLA))
    text = xm.get_stablehlo([out])
    assert text.count("stablehlo.convolution") == 2
    assert xm.get_stablehlo_bytecode([out])[:4] == b"ML\xefR"
    assert_same(out, m(x), rtol=1e-5, atol=1e-5)       # reading the text ran nothing wrong


_HLO_DEBUG = r"""
import torch, torch_xla, torch_xla.core.xla_model as xm
x = torch.arange(9.0).reshape(3, 3).to(torch_xla.device())
y = torch.relu(x @ x - 20)
z = y.sum() * 2
print(xm.get_stablehlo([z]))
print("VALUE", z.item())
"""


def test_xla_hlo_debug_locations_are_python_source_lines(tmp_path):
    script = tmp_path / "user_code.py"
    script.write_text(_HLO_DEBUG)
    env = dict(os.environ, XLA_HLO_DEBUG="1", PJRT_DEVICE="CPU")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "#loc" in res.stdout and "user_code.py:4" in res.stdout and "user_code.py:5" in res.stdout
    x = torch.arange(9.0).reshape(3, 3)
    assert float(res.stdout.split("VALUE")[1]) == (torch.relu(x @ x - 20).sum() * 2).item()


def test_export_bilinear_upsampling_matches_cpu():
    class Up(torch.nn.Module):
        def forward(self, m):
            return torch.nn.functional.interpolate(m, size=(250, 250), mode="bilinear", align_corners=False)

    torch.manual_seed(0)
    x = torch.randn(2, 3, 100, 100)
    out = exported_program_to_stablehlo(torch.export.export(Up(), (x,)))(x)
    assert_same(out, Up()(x), rtol=1e-5, atol=1e-4)


# Composites: StableHLOCompositeBuilder marks a pattern; its StableHLO is one op.

class _Attention(torch.nn.Module):
    """Two marked attention patterns, the second with a scale that is a graph scalar."""

    def forward(self, x, y, scale: float = 4.0):
        from torch_xla.experimental.mark_pattern_utils import StableHLOCompositeBuilder
        b = StableHLOCompositeBuilder("test.sdpa", {"scale": 0.25, "ints": [1, 2], "flag": True, "s": "hi"})
        q, k, v = b.mark_inputs(*x.split(4, dim=-2))
        out = b.mark_outputs(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25))
        b2 = StableHLOCompositeBuilder("test.sdpa", {"scale": 2})
        q, k, v = b2.mark_inputs(*y.split(4, dim=-2))
        out2 = b2.mark_outputs(torch.nn.functional.scaled_dot_product_attention(q, k, v) * scale)
        return out + 1, out2


def test_composite_builder_on_the_lazy_path_matches_cpu():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    m = _Attention()
    for scale in (4.0, 0.5):      # the scale is a graph parameter: one program, both values right
        ref = m(x, y, scale)
        out = m(x.to(XLA), y.to(XLA), scale)
        text = xm.get_stablehlo(list(out))
        assert text.count('stablehlo.composite "test.sdpa"') == 2
        assert ('composite_attributes = {flag = true, ints = dense<[1, 2]> : tensor<2xi64>, '
                's = "hi", scale = 2.500000e-01 : f32}, decomposition = @test.sdpa.impl}') in text
        assert "{composite_attributes = {scale = 2 : i64}, decomposition = @test.sdpa.impl_0}" in text
        assert_same(out[0], ref[0], rtol=1e-5, atol=1e-5)
        assert_same(out[1], ref[1], rtol=1e-5, atol=1e-5)


def test_composite_in_exported_program_runs_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    ep = torch.export.export(_Attention(), (x, y))
    shlo = exported_program_to_stablehlo(ep)
    text = shlo.get_stablehlo_text()
    assert text.count('stablehlo.composite "test.sdpa"') == 2
    assert text.count("func.func private @test.sdpa.impl") == 2
    ref = _Attention()(x, y)
    assert_same(shlo(x, y)[1], ref[1], rtol=1e-5, atol=1e-5)
    shlo.save(tmp_path / "e")
    loaded = StableHLOGraphModule.load(tmp_path / "e")
    assert_same(loaded(x, y)[0], ref[0], rtol=1e-5, atol=1e-5)


def test_mark_tensor_values_inside_pattern_read_outside_and_bad_attributes():
    def f(x, w):
        a = torch.ops.xla.mark_tensor(x, "test.p", 0, "0", True)
        h = a * w                                # read inside the pattern and after it
        out = torch.ops.xla.mark_tensor(torch.tanh(h) + a, "test.p", 0, "0", False)
        return out * 2 + h

    x, w = torch.randn(5, 5), torch.randn(5, 5)
    ref = f(x, w)
    out = f(x.to(XLA), w.to(XLA))
    text = xm.get_stablehlo([out])
    assert text.count('stablehlo.composite "test.p"') == 1 and "{decomposition = @test.p.impl}" in text
    assert_same(out, ref, rtol=1e-6, atol=1e-6)
    for dev in ("cpu", XLA):
        with pytest.raises(ValueError, match="attr value"):
            torch.ops.xla.mark_tensor(x.to(dev), "test.p", 0, "1", False, attr=(("bad", 1j),))
    from torch_xla.experimental.xla_marker import serialize_composite_attr
    with pytest.raises(ValueError, match="dictionary"):
        serialize_composite_attr([("a", 1)])


# Unbounded sizes on the lazy path: `_xla_mark_dynamic` makes a size `?` in the text.

def test_mark_dynamic_broadcasts_at_run_time_in_the_text_and_runs_with_real_sizes():
    torch.manual_seed(0)
    a, b = torch.randn(6, 1, 5), torch.randn(4, 5)
    xa, xb = a.to(XLA), b.to(XLA)
    torch_xla._XLAC._xla_mark_dynamic(xa, 0)
    torch_xla._XLAC._xla_mark_dynamic(xb, -2)
    out = torch.exp(xa * xb + 0.5)
    text = xm.get_stablehlo([out])
    assert "tensor<?x1x5xf32>" in text and "tensor<?x5xf32>" in text
    assert re.search(r"dynamic_broadcast_in_dim .*dims = \[1, 2\] : \(tensor<\?x5xf32>, tensor<3xi32>\) "
                     r"-> tensor<\?x\?x5xf32>", text)
    assert_same(out, torch.exp(a * b + 0.5), rtol=1e-6, atol=1e-6)   # running uses the real sizes


def test_mark_dynamic_refuses_what_it_cannot_lower():
    xa = torch.randn(6, 5).to(XLA)
    torch_xla._XLAC._xla_mark_dynamic(xa, 0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch_xla._XLAC._xla_mark_dynamic(xa, 2)
    with pytest.raises(IndexError):
        torch.randn(6, 5).size(2)                  # the CPU's exception for the same mistake
    with pytest.raises(ValueError, match="device data"):
        torch_xla._XLAC._xla_mark_dynamic(xa + 1, 0)
    s = (xa * 2).sum(0)
    with pytest.raises(RuntimeError, match="elementwise ops only"):
        xm.get_stablehlo([s])


def test_export_scalar_operands_are_constants_of_the_op_shape():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.rsub(x, 1.0) * 2.5 + x / 3.0

    x = torch.rand(2, 3)
    shlo = exported_program_to_stablehlo(torch.export.export(M(), (x,)))
    text = shlo.get_stablehlo_text()
    for v in ("1.000000e+00", "2.500000e+00", "3.000000e+00"):
        assert f"stablehlo.constant dense<{v}> : tensor<2x3xf32>" in text
    assert "broadcast_in_dim" not in text
    assert_same(shlo(x), M()(x), rtol=1e-6, atol=1e-6)


def test_export_of_graphs_that_recorded_the_cpu_device():
    class M(torch.nn.Module):
        def forward(self, x):   # `.float()` asserts the traced device; `torch.ones` makes a tensor there
            return (x == 0.5).float() + torch.lerp(x, torch.ones(2, 3), 0.25)

    x = torch.rand(2, 3)
    x[0, 0] = 0.5
    assert_same(exported_program_to_stablehlo(torch.export.export(M(), (x,)))(x), M()(x), rtol=1e-6, atol=1e-6)


def test_pattern_fed_by_its_own_output_is_not_grouped_and_stays_correct():
    def f(x):
        a = torch.ops.xla.mark_tensor(x, "test.p", 0, "0", True)
        o = torch.ops.xla.mark_tensor(a * 2, "test.p", 0, "0", False)
        b = torch.ops.xla.mark_tensor(o + 1, "test.p", 1, "0", True)   # an input made from an output
        return torch.ops.xla.mark_tensor(b * 3, "test.p", 1, "0", False)

    x = torch.randn(4)
    out = f(x.to(XLA))
    assert "stablehlo.composite" not in xm.get_stablehlo([out])
    assert_same(out, f(x))
