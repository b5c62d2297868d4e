"""stablehlo_custom_call, the host-offloading placement annotations and MLIR debug info
in exported StableHLO; placement values and gradients against eager CPU."""
from __future__ import annotations

import re

import pytest
import torch
from torch.library import Library, impl

import torch_xla.core.xla_model as xm
from torch_xla.experimental.stablehlo_custom_call import place_to_device, place_to_host, stablehlo_custom_call
from torch_xla.experimental.xla_mlir_debuginfo import write_mlir_debuginfo
from torch_xla.stablehlo import StableHLOExportOptions, exported_program_to_stablehlo
from helpers import XLA

_lib = Library("shlo_cc_test", "DEF")
_lib.define("scramble(Tensor x) -> Tensor")
_lib.define("split2(Tensor x, Tensor y) -> (Tensor, Tensor)")
_lib.define("pack(Tensor x) -> Tensor")


@impl(_lib, "scramble", "Meta")
def _scramble_meta(x):
    return torch.empty_like(x)


@impl(_lib, "split2", "Meta")
def _split2_meta(x, y):
    return torch.empty_like(x), torch.empty(y.shape[1:], dtype=torch.int32, device="meta")


@impl(_lib, "pack", "Meta")
def _pack_meta(x):
    return torch.empty(x.shape[1:], dtype=torch.int8, device="meta")


@impl(_lib, "pack", "XLA")
def _pack_xla(x):
    # PyTorch/XLA's dispatch key: the export runs this kernel for the op
    return stablehlo_custom_call((x,), "my_pack", [x.shape[1:]], [torch.int8], True, "cfg-v1", 1,
                                 {"kind": "packed"})


def test_custom_call_kernel_in_export():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.shlo_cc_test.pack(torch.sin(x)).float() + 1

    text = exported_program_to_stablehlo(torch.export.export(M(), (torch.randn(3, 4),))).get_stablehlo_text()
    line = next(ln for ln in text.split("\n") if "stablehlo.custom_call" in ln)
    assert "@my_pack(" in line
    assert 'backend_config = "cfg-v1"' in line and "has_side_effect = true" in line
    assert 'mhlo.frontend_attributes = {kind = "packed"}' in line
    assert re.search(r": \(tensor<3x4xf32>\) -> tensor<4xi8>", line)


def test_custom_ops_allowed_in_graph_single_and_multiple_outputs():
    class M(torch.nn.Module):
        def forward(self, x, y):
            x = torch.ops.shlo_cc_test.scramble(torch.sin(x))
            a, b = torch.ops.shlo_cc_test.split2(x, y)
            return torch.cos(a), b

    options = StableHLOExportOptions()
    options.custom_ops_allowed_in_graph.add("shlo_cc_test")
    ep = torch.export.export(M(), (torch.randn(3, 3), torch.randn(5, 5)))
    text = exported_program_to_stablehlo(ep, options).get_stablehlo_text()
    assert re.search(r"stablehlo\.custom_call @shlo_cc_test\.scramble\.default\(.*\) : "
                     r"\(tensor<3x3xf32>\) -> tensor<3x3xf32>", text)
    assert re.search(r"stablehlo\.custom_call @shlo_cc_test\.split2\.default\(.*\) : "
                     r"\(tensor<3x3xf32>, tensor<5x5xf32>\) -> tuple<tensor<3x3xf32>, tensor<5xi32>>", text)
    assert text.count("stablehlo.get_tuple_element") == 2
    assert "has_side_effect" not in text


def test_custom_call_arguments_checked():
    x = torch.ones(2, device=XLA)
    with pytest.raises(ValueError, match="output shapes"):
        stablehlo_custom_call([x], "t", [(2,)], [torch.float32, torch.int8])
    with pytest.raises(RuntimeError, match="xla tensors"):
        stablehlo_custom_call([torch.ones(2)], "t", [(2,)], [torch.float32])


def test_placement_annotations_in_text():
    a = torch.arange(6, dtype=torch.float32, device=XLA)
    text = xm.get_stablehlo([place_to_device(place_to_host(a) * 2)])
    host = re.search(r"stablehlo\.custom_call @annotate_device_placement.*"
                     r"mhlo\.frontend_attributes = \{_xla_buffer_placement = \"pinned_host\"\}", text)
    dev = re.search(r"stablehlo\.custom_call @annotate_device_placement.*"
                    r"mhlo\.frontend_attributes = \{_xla_buffer_placement = \"device\"\}", text)
    assert host and dev
    assert text.count("has_side_effect = true") == 2


def test_placement_values_and_gradients_match_cpu():
    base = torch.randn(4, 5)
    grads = []
    for dev in ("cpu", XLA):
        a = base.detach().to(dev).requires_grad_()
        y = place_to_device(torch.tanh(place_to_host(a)) * 3)
        (y ** 2).sum().backward()
        grads.append((y.detach().cpu(), a.grad.cpu()))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-5, atol=1e-5)


def test_placement_under_aot_autograd():
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    a = torch.randn(6, device=XLA, requires_grad=True)
    out = aot_function(lambda x: (place_to_device(place_to_host(x)) * x).sum(), keep)(a)
    out.backward()
    fw, bw = graphs
    assert "place_to_host" in fw.code and "place_to_device" in fw.code
    assert "torch.ops.xla.place_to" not in bw.code
    ac = a.detach().cpu()
    torch.testing.assert_close(out.detach().cpu(), (ac * ac).sum())
    torch.testing.assert_close(a.grad.cpu(), 2 * ac)


def test_write_mlir_debuginfo_locations_and_values():
    class M(torch.nn.Module):
        def forward(self, x, y):
            x = write_mlir_debuginfo(x * y, 'scaled "x"')
            return torch.ops.xla.write_mlir_debuginfo(x - y, "MY_SUB")

    args = (torch.rand(4), torch.rand(4))
    shlo = exported_program_to_stablehlo(torch.export.export(M(), args))
    text = shlo.get_stablehlo_text()
    assert re.search(r'stablehlo\.multiply .* loc\("scaled \\22x\\22"\)', text)
    assert re.search(r'stablehlo\.subtract .* loc\("MY_SUB"\)', text)
    ref = M()(*args)   # elsewhere the op is the value itself
    torch.testing.assert_close(shlo(*args).cpu(), ref)
    torch.testing.assert_close(M()(*(a.to(XLA) for a in args)).cpu(), ref)


def test_export_node_metadata():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.fc(x))

    ep = torch.export.export(M(), (torch.rand(2, 4),))
    plain = exported_program_to_stablehlo(ep).get_stablehlo_text()
    options = StableHLOExportOptions()
    options.export_node_metadata = True
    text = exported_program_to_stablehlo(ep, options).get_stablehlo_text()
    assert "stack_trace" not in plain
    line = next(ln for ln in text.split("\n") if "stablehlo.maximum" in ln)
    assert "stack_trace" in line and "nn_module_stack" in line and "source_fn_stack" in line
    assert "torch.relu(self.fc(x))" in line
    fc_line = next(ln for ln in text.split("\n") if "stablehlo.dot_general" in ln)
    assert "torch.nn.modules.linear.Linear" in fc_line
