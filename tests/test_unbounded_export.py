"""Export with unbounded `torch.export.Dim` sizes: `?` dimensions in the StableHLO text,
exported programs run at other sizes against eager CPU, and the FX passes of
`torch_xla.experimental.unbounded_dynamism_export` against the graphs they rewrite."""
from __future__ import annotations

import operator
import re

import pytest
import torch
from torch.export import Dim, export

import torch_xla.experimental.unbounded_dynamism_export as ude
from torch_xla.experimental.xla_dynamic_reshape_ops import dynamic_expand, dynamic_view
from torch_xla.stablehlo import exported_program_to_stablehlo
from torch_xla.utils.stablehlo_test_utils import wrap_func_as_nn_module
from helpers import XLA, assert_same

aten = torch.ops.aten


def _main(shlo) -> str:
    return next(line for line in shlo.get_stablehlo_text().splitlines() if "func.func public @main" in line)


def _sized(shape, dim, n):
    shape = list(shape)
    shape[dim] = n
    return shape


class _Slice(torch.nn.Module):
    def forward(self, x):   # end = INT64_MAX on the unbounded dimension
        return aten.slice.Tensor(x, 0, 0, 9223372036854775807) * 2


class _SliceFrom(torch.nn.Module):
    def forward(self, x):
        return x[1:] + 1


class _SliceScatter(torch.nn.Module):
    def forward(self, x, y):
        return aten.slice_scatter.default(x, y, 0, 0, 9223372036854775807)


class _Select(torch.nn.Module):
    def forward(self, x):
        return x.select(1, -1)


class _Split(torch.nn.Module):
    def forward(self, x):
        a, b, c = torch.split(x, [1, 2, 3], -1)
        return a, c * b.sum(-1, keepdim=True)


class _View(torch.nn.Module):
    def forward(self, x):
        return x.view(x.shape[0] * x.shape[1], -1) + 1


class _Expand(torch.nn.Module):
    def forward(self, x, image):
        return x.expand(image.shape[0], -1, -1) * 3


class _GroupNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.norm(x)


# (module, example inputs, dynamic shapes, regex of @main's signature, sizes to run at)
CASES = {
    "slice_to_int64_max": (_Slice(), (torch.randn(3, 4),), ({0: Dim("b")},),
                           r"tensor<\?x4xf32>.*->.*tensor<\?x4xf32>", (1, 6)),
    "slice_from_one": (_SliceFrom(), (torch.randn(4, 4),), ({0: Dim("b", min=3)},),
                       r"tensor<\?x4xf32>.*->.*tensor<\?x4xf32>", (3, 7)),
    "slice_scatter": (_SliceScatter(), (torch.randn(3, 4), torch.randn(3, 4)), ({0: Dim("b")}, {0: Dim("b")}),
                      r"tensor<\?x4xf32>.*tensor<\?x4xf32>.*->.*tensor<\?x4xf32>", (1, 5)),
    "select": (_Select(), (torch.randn(3, 5, 4),), ({0: Dim("b")},),
               r"tensor<\?x5x4xf32>.*->.*tensor<\?x4xf32>", (1, 6)),
    "split_with_sizes": (_Split(), (torch.randn(3, 2, 6),), ({0: Dim("b")},),
                         r"tensor<\?x2x6xf32>.*->.*tensor<\?x2x1xf32>.*tensor<\?x2x3xf32>", (1, 5)),
    "view_of_product": (_View(), (torch.randn(3, 4, 5),), ({0: Dim("b")},),
                        r"tensor<\?x4x5xf32>.*->.*tensor<\?x5xf32>", (1, 6)),
    "expand_to_other_input": (_Expand(), (torch.randn(1, 2, 3), torch.randn(4, 2)), (None, {0: Dim("b")}),
                              r"->.*tensor<\?x2x3xf32>", (1, 7)),
    "group_norm": (_GroupNorm().eval(), (torch.randn(3, 4, 5),), ({0: Dim("b")},),
                   r"tensor<\?x4x5xf32>.*->.*tensor<\?x4x5xf32>", (1, 6)),
    "softmax_on_dynamic_dim": (wrap_func_as_nn_module(lambda x: torch.softmax(x, -1)), (torch.randn(2, 3),),
                               (({1: Dim("n")},),), r"tensor<2x\?xf32>.*->.*tensor<2x\?xf32>", (1, 8)),
    "bmm_dynamic_out_dim": (wrap_func_as_nn_module(torch.bmm), (torch.randn(2, 3, 4), torch.randn(2, 4, 3)),
                            ((None, {2: Dim("n")}),), r"tensor<2x4x\?xf32>.*->.*tensor<2x3x\?xf32>", (1, 6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unbounded_export_text_and_values_match_cpu(name):
    m, args, dynamic_shapes, signature, sizes = CASES[name]
    ep = export(m, args, dynamic_shapes=dynamic_shapes)
    shlo = exported_program_to_stablehlo(ep)
    assert re.search(signature, _main(shlo)), _main(shlo)
    flat_specs = dynamic_shapes[0] if len(dynamic_shapes) == 1 and isinstance(dynamic_shapes[0], tuple) \
        else dynamic_shapes
    for n in sizes:
        new = tuple(torch.randn(_sized(a.shape, next(iter(spec)), n)) if spec else a
                    for a, spec in zip(args, flat_specs))
        assert_same(shlo(*new), m(*new), rtol=1e-5, atol=1e-5)


def test_embedding_with_dynamic_indices_runs_at_other_sizes():
    w = torch.randn(20, 6)
    m = wrap_func_as_nn_module(aten.embedding.default)
    ep = export(m, (w, torch.randint(0, 20, (3, 4))), dynamic_shapes=((None, {0: Dim("b")}),))
    shlo = exported_program_to_stablehlo(ep)
    assert re.search(r"tensor<\?x4xi64>.*->.*tensor<\?x4x6xf32>", _main(shlo))
    for n in (1, 5):
        i = torch.randint(0, 20, (n, 4))
        assert_same(shlo(w, i), m(w, i))


# -- the xla ops -----------------------------------------------------------------------------

def test_dynamic_view_and_expand_ops_match_cpu_and_refuse_as_pytorch():
    x, src = torch.randn(3, 4, 5), torch.randn(3, 7)
    for dev in ("cpu", XLA):
        xs, ss = x.to(dev), src.to(dev)
        assert_same(dynamic_view(xs, [-1, 5], ss, 0, 0, 4), x.view(12, 5))
        assert_same(torch.ops.xla.dynamic_view(xs, [1, 20], ss, 0, 0, 1.0), x.view(3, 20))
        assert_same(dynamic_expand(xs[:1], [0, 4, 5], ss, 0, 0), x[:1].expand(3, 4, 5))
    with pytest.raises(RuntimeError, match="is invalid for input of size 60"):
        x.view(7, 5)
    for dev in ("cpu", XLA):
        with pytest.raises(RuntimeError, match="is invalid for input of size 60"):
            dynamic_view(x.to(dev), [-1, 5], src.to(dev), 1, 0, 1)
        with pytest.raises(RuntimeError, match="must match the existing size"):
            dynamic_expand(x.to(dev), [0, 4, 5], src.to(dev), 1, 0)


# -- the FX passes ---------------------------------------------------------------------------

def _targets(ep):
    return [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]


def _rewritten(m, args, dynamic_shapes, *passes):
    ep = export(m, args, dynamic_shapes=dynamic_shapes)
    for p in passes:
        p(ep.graph_module)
    ep.graph_module.graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return ep


def test_select_pass_slices_and_views_and_keeps_values():
    x = torch.randn(3, 5, 4)
    ep = _rewritten(_Select(), (x,), ({0: Dim("b")},), ude.decompose_dynamic_shape_select)
    t = _targets(ep)
    assert aten.select.int not in t and aten.slice.Tensor in t and aten.view.default in t
    ude.replace_dynamic_view_with_xla_op(ep.graph_module)
    ep.graph_module.recompile()
    assert torch.ops.xla.dynamic_view.default in _targets(ep) and aten.view.default not in _targets(ep)
    for n in (1, 3, 6):   # the negative index stays the last row
        xn = torch.randn(n, 5, 4)
        torch.testing.assert_close(ep.module()(xn), _Select()(xn))


def test_select_on_the_dynamic_dim_is_left_alone():
    m = wrap_func_as_nn_module(lambda x: x.select(0, 1))
    ep = _rewritten(m, (torch.randn(3, 4),), (({0: Dim("b")},),), ude.decompose_dynamic_shape_select)
    assert aten.select.int in _targets(ep)


def test_split_pass_gives_slices():
    x = torch.randn(3, 2, 6)
    ep = _rewritten(_Split(), (x,), ({0: Dim("b")},), ude.decompose_split_with_sizes)
    assert aten.split_with_sizes.default not in _targets(ep) and _targets(ep).count(aten.slice.Tensor) >= 2
    xn = torch.randn(5, 2, 6)
    for a, b in zip(ep.module()(xn), _Split()(xn)):
        torch.testing.assert_close(a, b)


def test_no_op_slices_removed_others_kept():
    class M(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            return aten.slice.Tensor(y, 1, 0, 9223372036854775807)[:, :3] + aten.slice.Tensor(y, 1, 1, 4)

    x = torch.randn(3, 4)
    ep = export(M(), (x,), dynamic_shapes=({0: Dim("b")},))
    assert _targets(ep).count(aten.slice.Tensor) == 4     # [:, :3] slices dimension 0 too
    ude.remove_no_op_slice(ep.graph_module)
    ep.graph_module.recompile()
    slices = [n.args[1:4] for n in ep.graph_module.graph.nodes if n.target is aten.slice.Tensor]
    assert sorted(slices) == [(1, 0, 3), (1, 1, 4)]
    xn = torch.randn(6, 4)
    torch.testing.assert_close(ep.module()(xn), M()(xn))


def test_embedding_pass_flattens_indices_and_views_become_xla_ops():
    w = torch.randn(20, 6)
    m = wrap_func_as_nn_module(aten.embedding.default)
    ep = _rewritten(m, (w, torch.randint(0, 20, (3, 4, 2))), ((None, {0: Dim("b")}),),
                    ude.flatten_embedding_indices_tensor)
    emb = next(n for n in ep.graph_module.graph.nodes if n.target is aten.embedding.default)
    assert len(emb.args[1].meta["val"].shape) == 1
    ude.replace_dynamic_view_with_xla_op(ep.graph_module)
    ep.graph_module.recompile()
    views = [n for n in ep.graph_module.graph.nodes if n.target is torch.ops.xla.dynamic_view.default]
    assert len(views) == 2 and views[0].args[-1] == 8.0   # the flat size: b * 4 * 2
    i = torch.randint(0, 20, (5, 4, 2))
    torch.testing.assert_close(ep.module()(w, i), m(w, i))


def test_unsqueeze_pass_gives_a_view():
    m = wrap_func_as_nn_module(lambda x: x.unsqueeze(-1) * 2)
    ep = _rewritten(m, (torch.randn(2, 3),), (({1: Dim("n")},),), ude.dynamic_unsqueeze_to_view)
    assert aten.unsqueeze.default not in _targets(ep) and aten.view.default in _targets(ep)
    xn = torch.randn(2, 7)
    torch.testing.assert_close(ep.module()(xn), m(xn))


def test_view_and_expand_passes_take_one_dynamic_size_and_leave_the_rest():
    x = torch.randn(3, 4, 5)
    ep = _rewritten(_View(), (x,), ({0: Dim("b")},), ude.replace_dynamic_view_with_xla_op)
    view = next(n for n in ep.graph_module.graph.nodes if n.target is torch.ops.xla.dynamic_view.default)
    assert view.args[3:] == (0, 0, 4.0)
    xn = torch.randn(6, 4, 5)
    torch.testing.assert_close(ep.module()(xn), _View()(xn))

    ep = _rewritten(_Expand(), (torch.randn(1, 2, 3), torch.randn(4, 2)), (None, {0: Dim("b")}),
                    ude.replace_dynamic_expand_with_xla_op)
    assert torch.ops.xla.dynamic_expand.default in _targets(ep)
    a, img = torch.randn(1, 2, 3), torch.randn(6, 2)
    torch.testing.assert_close(ep.module()(a, img), _Expand()(a, img))

    class Two(torch.nn.Module):   # two dynamic sizes in one view: not rewritten
        def forward(self, x):
            return x.view(x.shape[0], x.shape[1], -1)

    ep = _rewritten(Two(), (torch.randn(3, 4, 5),), ({0: Dim("b"), 1: Dim("n")},),
                    ude.replace_dynamic_view_with_xla_op)
    assert torch.ops.xla.dynamic_view.default not in _targets(ep)
    assert any(n.target is operator.mul or n.target is aten.sym_size.int for n in ep.graph_module.graph.nodes)


def test_norm_impls_and_passes_match_pytorch():
    x, w, b = torch.randn(3, 4, 6), torch.randn(6), torch.randn(6)
    ref = aten.native_layer_norm.default(x, [6], w, b, 1e-5)[0]
    torch.testing.assert_close(ude.native_layer_norm_impl(x, [6], w, b, 1e-5), ref)
    torch.testing.assert_close(ude.native_layer_norm_impl(x, [4, 6], None, None, 1e-5),
                               aten.native_layer_norm.default(x, [4, 6], None, None, 1e-5)[0])
    gw, gb = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(ude.native_group_norm_impl(x, gw, gb, 3, 4, 6, 2, 1e-5),
                               aten.native_group_norm.default(x, gw, gb, 3, 4, 6, 2, 1e-5)[0])

    class LN(torch.nn.Module):
        def forward(self, x, w, b):
            out, mean, rstd = aten.native_layer_norm.default(x, [6], w, b, 1e-5)
            return out, mean + rstd

    ep = export(LN(), (x, w, b), dynamic_shapes=({0: Dim("b")}, None, None)).run_decompositions({})
    ude.decompose_dynamic_native_layer_norm(ep.graph_module)
    ep.graph_module.recompile()
    assert aten.native_layer_norm.default not in _targets(ep)
    xn = torch.randn(5, 4, 6)
    for got, want in zip(ep.module()(xn, w, b), LN()(xn, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    gn = _GroupNorm().eval()
    ep = export(gn, (x[:, :, :5].reshape(3, 4, 5).contiguous(),), dynamic_shapes=({0: Dim("b")},))
    ude.decompose_dynamic_native_group_norm(ep.graph_module)
    ep.graph_module.recompile()
    assert aten.group_norm.default not in _targets(ep) and aten.native_group_norm.default not in _targets(ep)
    xn = torch.randn(7, 4, 5)
    torch.testing.assert_close(ep.module()(xn), gn(xn), rtol=1e-5, atol=1e-5)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, idx, ctx):
        h = self.norm(self.emb(idx))                       # (B, T, 8)
        h = h + ctx[:, 0:].expand(idx.shape[0], -1, -1)    # (B, 1, 8) broadcast over T
        h = h.view(h.shape[0] * h.shape[1], -1)            # (B*T, 8)
        return self.proj(h).unsqueeze(1).select(1, 0)      # (B*T, 8)


def test_pipeline_then_export_runs_and_matches_cpu():
    torch.manual_seed(0)
    m = _Model().eval()
    idx, ctx = torch.randint(0, 16, (2, 3)), torch.randn(1, 1, 8)
    ep = export(m, (idx, ctx), dynamic_shapes=({0: Dim("b")}, None))
    assert ude.exported_program_has_symbolic_input_shape(ep)
    assert not ude.exported_program_has_symbolic_input_shape(export(m, (idx, ctx)))
    ude.process_exported_program_with_symbolic_input(ep)
    t = _targets(ep)
    assert torch.ops.xla.dynamic_view.default in t and torch.ops.xla.dynamic_expand.default in t
    assert aten.select.int not in t and aten.unsqueeze.default not in t and aten.layer_norm.default not in t
    for n in (1, 4):
        i = torch.randint(0, 16, (n, 3))
        torch.testing.assert_close(ep.module()(i, ctx), m(i, ctx), rtol=1e-5, atol=1e-5)
    shlo = exported_program_to_stablehlo(ep)   # the xla ops export with the size symbolic
    assert re.search(r"tensor<\?x3xi64>.*->.*tensor<\?x8xf32>", _main(shlo)), _main(shlo)
    for n in (1, 5):
        i = torch.randint(0, 16, (n, 3))
        assert_same(shlo(i, ctx), m(i, ctx), rtol=1e-5, atol=1e-5)
