"""FX passes over the graph of a `torch.export.ExportedProgram` with dynamic (`Dim`) sizes.

Each pass rewrites ops whose result shape depends on a dynamic input size into ops that
name that size explicitly: `aten.sym_size` values, or the ops of
`torch_xla.experimental.xla_dynamic_reshape_ops` (`xla.dynamic_view`,
`xla.dynamic_expand`), which say which tensor dimension a size comes from. The graph
computes what it computed before. A node a pass cannot express (two dynamic sizes where
one is supported, a size of another form) is left as it is.

`torch_xla.stablehlo.exported_program_to_stablehlo` does not need them (it fits the
sizes itself) and exports graphs they produced. Passes change `gm.graph` in place; call
`gm.recompile()` afterwards (`process_exported_program_with_symbolic_input` runs them all,
removes dead nodes and recompiles).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.operator_schemas import normalize_function

from . import xla_dynamic_reshape_ops  # noqa: F401  (defines torch.ops.xla.dynamic_view / dynamic_expand)

__all__ = [
    "native_layer_norm_impl", "native_group_norm_impl", "decompose_dynamic_native_layer_norm",
    "decompose_dynamic_native_group_norm", "decompose_dynamic_shape_select", "decompose_split_with_sizes",
    "flatten_embedding_indices_tensor", "remove_no_op_slice", "replace_dynamic_expand_with_xla_op",
    "replace_dynamic_view_with_xla_op", "dynamic_unsqueeze_to_view", "exported_program_has_symbolic_input_shape",
    "process_exported_program_with_symbolic_input",
]

aten = torch.ops.aten
_INT64_MAX = torch.iinfo(torch.int64).max


# -- helpers -------------------------------------------------------------------------------

def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, Node) else x


def _shape(n: Any) -> Optional[Tuple]:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _symbolic_dims(shape: Optional[Sequence]) -> List[int]:
    return [] if shape is None else [d for d, s in enumerate(shape) if not isinstance(s, int)]


def _emit(graph: Graph, target: Callable, args: tuple, kwargs: Optional[Dict] = None) -> Node:
    """A new node calling `target`, with its `meta["val"]` computed from its inputs' (fake)
    values, as export records it (later passes read the shapes there)."""
    node = graph.call_function(target, args, kwargs or {})
    fargs, fkwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _val)
    fake_mode = torch._guards.detect_fake_mode([a for a in torch.utils._pytree.tree_leaves((fargs, fkwargs))
                                                if isinstance(a, torch.Tensor)])
    if fake_mode is not None or not any(isinstance(a, torch.Tensor)
                                        for a in torch.utils._pytree.tree_leaves((fargs, fkwargs))):
        try:
            if fake_mode is None:
                node.meta["val"] = target(*fargs, **fkwargs)
            else:
                with fake_mode:
                    node.meta["val"] = target(*fargs, **fkwargs)
        except Exception:  # noqa: BLE001  (a value is a hint for later passes, not required)
            pass
    return node


def _size_nodes(graph: Graph, src: Node, shape: Sequence) -> List:
    """`shape` with each dynamic size replaced by an `aten.sym_size.int(src, dim)` node."""
    return [s if isinstance(s, int) else _emit(graph, aten.sym_size.int, (src, d)) for d, s in enumerate(shape)]


def _calls(gm: GraphModule, *targets) -> List[Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


# -- layer norm / group norm -------------------------------------------------------------

def native_layer_norm_impl(input: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor],
                           bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """`aten.native_layer_norm(...)[0]` as mean / var / rsqrt over the normalized
    dimensions (ops that keep the other sizes as they are)."""
    dims = list(range(-len(normalized_shape), 0))
    mean = torch.mean(input, dims, keepdim=True)
    rstd = torch.rsqrt(torch.var(input, dims, keepdim=True, correction=0) + eps)
    out = (input - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def native_group_norm_impl(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                           N: int, C: int, HxW: int, group: int, eps: float) -> torch.Tensor:
    """`aten.native_group_norm(...)[0]`: each group of channels normalized over its
    channels and spatial positions, then the per-channel affine transform."""
    x = input.reshape(N, group, (C // group) * HxW)
    mean = torch.mean(x, -1, keepdim=True)
    rstd = torch.rsqrt(torch.var(x, -1, keepdim=True, correction=0) + eps)
    out = ((x - mean) * rstd).reshape(input.shape)
    affine_shape = (C,) + (1,) * (input.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(affine_shape)
    if bias is not None:
        out = out + bias.reshape(affine_shape)
    return out


def _replace_items(graph: Graph, node: Node, outputs: Sequence[Optional[Node]]) -> None:
    """Points the users of `node` (a tuple-valued op: its `getitem`s) at `outputs`."""
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and outputs[user.args[1]] is not None:
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)


def _normalized(g: Graph, x: Node, dims: List[int], eps: float) -> Tuple[Node, Node, Node]:
    """(x - mean) * rsqrt(var + eps) over `dims` (kept), with the mean and the rsqrt."""
    mean = _emit(g, aten.mean.dim, (x, dims, True))
    var = _emit(g, aten.var.correction, (x, dims), {"correction": 0, "keepdim": True})
    rstd = _emit(g, aten.rsqrt.default, (_emit(g, aten.add.Tensor, (var, eps)),))
    return _emit(g, aten.mul.Tensor, (_emit(g, aten.sub.Tensor, (x, mean)), rstd)), mean, rstd


def _replace_norm(g: Graph, n: Node, single_output, outputs: Sequence[Optional[Node]]) -> None:
    """`n` replaced by `outputs[0]` when its target is `single_output` (the one-result op),
    else its items by `outputs`; erased when nothing uses it any more."""
    if n.target is single_output:
        n.replace_all_uses_with(outputs[0])
    else:
        _replace_items(g, n, outputs)
    if not n.users:
        g.erase_node(n)


def decompose_dynamic_native_layer_norm(gm: GraphModule) -> None:
    """`aten.native_layer_norm` (and `aten.layer_norm`) of an input with a dynamic size ->
    mean, var, rsqrt and elementwise ops (its three outputs: the result, the mean and the
    reciprocal deviation)."""
    g = gm.graph
    for n in _calls(gm, aten.native_layer_norm.default, aten.layer_norm.default):
        a = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True).kwargs
        x, normalized, weight, bias = a["input"], a["normalized_shape"], a.get("weight"), a.get("bias")
        eps = a.get("eps", 1e-5)
        if not _symbolic_dims(_shape(x)):
            continue
        dims = list(range(-len(normalized), 0))
        with g.inserting_before(n):
            out, mean, rstd = _normalized(g, x, dims, eps)
            if weight is not None:
                out = _emit(g, aten.mul.Tensor, (out, weight))
            if bias is not None:
                out = _emit(g, aten.add.Tensor, (out, bias))
        _replace_norm(g, n, aten.layer_norm.default, (out, mean, rstd))


def decompose_dynamic_native_group_norm(gm: GraphModule) -> None:
    """`aten.native_group_norm` (and `aten.group_norm`) of an input with a dynamic batch
    -> a view to (batch, groups, -1), mean / var / rsqrt over the last dimension, a view
    back and the per-channel affine transform."""
    g = gm.graph
    for n in _calls(gm, aten.native_group_norm.default, aten.group_norm.default):
        a = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True).kwargs
        x, weight, bias, eps = a["input"], a.get("weight"), a.get("bias"), a.get("eps", 1e-5)
        group = a["num_groups"] if n.target is aten.group_norm.default else a["group"]
        shape = _shape(x)
        if not _symbolic_dims(shape) or not isinstance(group, int) or _symbolic_dims(shape[1:]):
            continue
        c = shape[1]
        per_group = (c // group) * int(torch.Size(shape[2:]).numel())
        with g.inserting_before(n):
            batch = _emit(g, aten.sym_size.int, (x, 0))
            xg = _emit(g, aten.view.default, (x, [batch, group, per_group]))
            normed, mean, rstd = _normalized(g, xg, [-1], eps)
            out = _emit(g, aten.view.default, (normed, [batch] + list(shape[1:])))
            affine = [c] + [1] * (len(shape) - 2)
            if weight is not None:
                out = _emit(g, aten.mul.Tensor, (out, _emit(g, aten.view.default, (weight, affine))))
            if bias is not None:
                out = _emit(g, aten.add.Tensor, (out, _emit(g, aten.view.default, (bias, affine))))
            stats = (None, None)
            if n.target is aten.native_group_norm.default:
                stats = tuple(_emit(g, aten.view.default, (v, [batch, group])) for v in (mean, rstd))
        _replace_norm(g, n, aten.group_norm.default, (out,) + stats)


# -- select, split, slices, embedding, unsqueeze -------------------------------------------

def decompose_dynamic_shape_select(gm: GraphModule) -> None:
    """`aten.select.int` of an input with a dynamic size (on another dimension) -> a slice
    of length one and an `aten.view` dropping that dimension, its dynamic sizes read
    with `aten.sym_size`."""
    g = gm.graph
    for n in _calls(gm, aten.select.int):
        x, dim, index = n.args[:3]
        shape = _shape(x)
        dynamic = _symbolic_dims(shape)
        if not dynamic:
            continue
        dim = dim % len(shape)
        if dim in dynamic or not isinstance(index, int) or not -shape[dim] <= index < shape[dim]:
            continue   # an index out of range keeps the select, which raises PyTorch's error
        index %= shape[dim]
        with g.inserting_before(n):
            sliced = _emit(g, aten.slice.Tensor, (x, dim, index, index + 1, 1))
            sizes = _size_nodes(g, x, shape)
            del sizes[dim]
            view = _emit(g, aten.view.default, (sliced, sizes))
        n.replace_all_uses_with(view)
        g.erase_node(n)


def decompose_split_with_sizes(gm: GraphModule) -> None:
    """`aten.split_with_sizes` of an input with a dynamic size (on another dimension) ->
    one `aten.slice` per piece. The pieces' readers read the slices; the split and its
    `getitem`s are left without readers, for `graph.eliminate_dead_code()`."""
    g = gm.graph
    for n in _calls(gm, aten.split_with_sizes.default):
        x, sizes = n.args[:2]
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        shape = _shape(x)
        dynamic = _symbolic_dims(shape)
        if not dynamic or not all(isinstance(s, int) for s in sizes):
            continue
        dim = dim % len(shape)
        if dim in dynamic:
            continue
        with g.inserting_before(n):
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            pieces = [_emit(g, aten.slice.Tensor, (x, dim, s, s + size)) for s, size in zip(starts, sizes)]
        for user in list(n.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(pieces[user.args[1]])


def _is_no_op_slice(n: Node) -> bool:
    x = n.args[0]
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start", None)
    end = n.args[3] if len(n.args) > 3 else n.kwargs.get("end", None)
    step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
    if start not in (0, None) or step != 1:
        return False
    if end is None or (isinstance(end, int) and end >= _INT64_MAX):
        return True
    shape = _shape(x)
    if shape is None or not isinstance(dim, int) or not isinstance(end, int):
        return False
    size = shape[dim % len(shape)]
    return isinstance(size, int) and end >= size


def remove_no_op_slice(gm: GraphModule) -> None:
    """Removes `aten.slice` ops that take the whole dimension (start 0, step 1, end at or
    past its size: `x[:, 0:]`); their readers read the input."""
    g = gm.graph
    for n in _calls(gm, aten.slice.Tensor):
        if _is_no_op_slice(n):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)


def flatten_embedding_indices_tensor(gm: GraphModule) -> None:
    """`aten.embedding` whose indices (two or more dimensions) have a dynamic size -> the
    embedding of the indices reshaped to one dimension, reshaped back to
    `indices.shape + (embedding_dim,)` (reshapes of one dynamic size each, which
    `replace_dynamic_view_with_xla_op` takes)."""
    g = gm.graph
    for n in _calls(gm, aten.embedding.default):
        weight, indices = n.args[:2]
        shape, wshape = _shape(indices), _shape(weight)
        dynamic = _symbolic_dims(shape)
        if len(dynamic) != 1 or len(shape) < 2 or wshape is None:
            continue
        scale = 1
        for s in shape:
            scale *= s if isinstance(s, int) else 1
        with g.inserting_before(n):
            size = _emit(g, aten.sym_size.int, (indices, dynamic[0]))
            flat_size = size if scale == 1 else _emit(g, operator.mul, (size, scale))
            flat = _emit(g, aten.reshape.default, (indices, [flat_size]))
        n.update_arg(1, flat)
        if "val" in n.meta and isinstance(_val(flat), torch.Tensor):
            n.meta["val"] = n.meta["val"].reshape(_val(flat).shape + n.meta["val"].shape[-1:])
        with g.inserting_after(n):
            back = _emit(g, aten.reshape.default,
                         (n, [size if isinstance(s, torch.SymInt) else s for s in shape] + [wshape[-1]]))
        n.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def dynamic_unsqueeze_to_view(gm: GraphModule) -> None:
    """`aten.unsqueeze` of an input with a dynamic size -> `aten.view` with the new
    dimension of size one, the dynamic sizes read with `aten.sym_size`."""
    g = gm.graph
    for n in _calls(gm, aten.unsqueeze.default):
        x, dim = n.args[:2]
        shape = _shape(x)
        if not _symbolic_dims(shape):
            continue
        dim = dim % (len(shape) + 1)
        with g.inserting_before(n):
            sizes = _size_nodes(g, x, shape)
            sizes.insert(dim, 1)
            view = _emit(g, aten.view.default, (x, sizes))
        n.replace_all_uses_with(view)
        g.erase_node(n)


# -- views and expands to the xla ops ------------------------------------------------------

def _size_source(size: Any) -> Optional[Tuple[Node, int, int]]:
    """(tensor node, dimension, factor) of a size computed as `sym_size(t, d)` or
    `sym_size(t, d) * k` with an integer k; None for any other form."""
    if not isinstance(size, Node) or size.op != "call_function":
        return None
    if size.target is aten.sym_size.int:
        return size.args[0], size.args[1], 1
    if size.target is operator.mul:
        a, b = size.args
        if isinstance(b, Node):
            a, b = b, a
        inner = _size_source(a) if isinstance(b, int) else None
        if inner is not None:
            return inner[0], inner[1], inner[2] * b
    return None


def _one_dynamic(sizes: Sequence) -> Optional[Tuple[int, Tuple[Node, int, int]]]:
    dynamic = [(d, s) for d, s in enumerate(sizes) if not isinstance(s, int)]
    if len(dynamic) != 1:
        return None
    source = _size_source(dynamic[0][1])
    return None if source is None else (dynamic[0][0], source)


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view, aten.reshape,
          aten._unsafe_view)


def replace_dynamic_view_with_xla_op(gm: GraphModule) -> None:
    """`aten.view` / `aten.reshape` / `aten._unsafe_view` whose size list has one dynamic
    entry, `sym_size(t, d)` or `sym_size(t, d) * k` -> `xla.dynamic_view(x, sizes, t, d,
    target_dim, k)`."""
    for n in _calls(gm, *_VIEWS):
        found = _one_dynamic(n.args[1])
        if found is None:
            continue
        target_dim, (src, src_dim, scale) = found
        n.target = torch.ops.xla.dynamic_view.default
        n.args = (n.args[0], list(n.args[1]), src, src_dim, target_dim, float(scale))


def replace_dynamic_expand_with_xla_op(gm: GraphModule) -> None:
    """`aten.expand` whose size list has one dynamic entry `sym_size(t, d)` ->
    `xla.dynamic_expand(x, sizes, t, d, target_dim)`."""
    for n in _calls(gm, aten.expand.default):
        found = _one_dynamic(n.args[1])
        if found is None or found[1][2] != 1:
            continue
        target_dim, (src, src_dim, _) = found
        n.target = torch.ops.xla.dynamic_expand.default
        n.args = (n.args[0], list(n.args[1]), src, src_dim, target_dim)


# -- the whole pipeline -------------------------------------------------------------------

def exported_program_has_symbolic_input_shape(ep: torch.export.ExportedProgram) -> bool:
    """Whether a tensor input of `ep`'s graph has a dynamic size."""
    return any(n.op == "placeholder" and _symbolic_dims(_shape(n)) for n in ep.graph_module.graph.nodes)


_PASSES = (decompose_dynamic_shape_select, decompose_split_with_sizes, remove_no_op_slice,
           decompose_dynamic_native_group_norm, decompose_dynamic_native_layer_norm, dynamic_unsqueeze_to_view,
           flatten_embedding_indices_tensor, replace_dynamic_expand_with_xla_op, replace_dynamic_view_with_xla_op)


def process_exported_program_with_symbolic_input(ep: torch.export.ExportedProgram) -> None:
    """Runs every pass of this module on `ep`'s graph, in place, removing dead nodes and
    recompiling after each."""
    gm = ep.graph_module
    for p in _PASSES:
        p(gm)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
