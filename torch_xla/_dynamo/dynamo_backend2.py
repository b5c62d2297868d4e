"""A second dynamo backend: `torch.compile(f, backend=dynamo_backend)`.

It compiles the forward and backward graphs with aot_autograd's `aot_function` straight
into the bridge's captured programs (`torch_xla.core.dynamo_bridge`), one per graph, with
no per-call graph lookup through the registered `openxla` backend."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..core.dynamo_bridge import extract_compiled_graph


def _boxed(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    from functorch.compile import make_boxed_func
    return make_boxed_func(extract_compiled_graph(gm, example_inputs))


def dynamo_backend(gm: torch.fx.GraphModule,
                   example_inputs: Sequence[Any]) -> Callable:  # noqa: ARG001 (dynamo's backend signature)
    """A dynamo backend (`torch.compile(..., backend=dynamo_backend)`); `aot_function`
    traces the graph at its first call, from the inputs of that call."""
    from functorch.compile import aot_function
    return aot_function(gm, fw_compiler=_boxed, bw_compiler=_boxed)
