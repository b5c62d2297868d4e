"""`scan_layers`: a stack of layers of the same structure run as one `scan`.

A decoder's 32 layers, applied one after the other, are 32 copies of one layer for XLA to
compile. `scan_layers(layers, x)` stacks the layers' parameters and buffers along a new
leading dimension and scans the first layer's forward over them: the layer is traced and
compiled once. The stacking is an autograd op, so each layer's own parameters receive
their gradients: optimizers and checkpoints see the original modules.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Tuple

import torch
import torch.nn as nn
from functorch.compile import default_partition

from .scan import scan

# (id(partition_fn), id(first layer)) -> the step function scanned for those layers, kept
# so that `scan`'s own cache (keyed by the function) serves later calls.
_ONE_LAYER_CACHE: Dict[Tuple[int, int], Callable] = {}


def _state(layer: nn.Module) -> Dict[str, torch.Tensor]:
    return {**dict(layer.named_parameters()), **dict(layer.named_buffers())}


def scan_layers(layers: Iterable[nn.Module], input_data, partition_fn: Callable = default_partition,
                is_layer_pure: bool = False):
    """Applies `layers` in sequence to `input_data` as one scan.

    Args:
      layers: modules of identical structure (parameter names, shapes and dtypes), e.g. an
        `nn.ModuleList` of decoder layers. Each is called as `layer(x)`, or `layer(*x)`
        when `input_data` is a tuple (and then returns a tuple of the same structure).
      input_data: the first layer's input (a tensor or a tuple of tensors).
      partition_fn: see `scan`.
      is_layer_pure: the layer's forward depends only on its parameters, buffers and
        input: its traced graphs are cached and reused by later calls.

    Returns:
      The last layer's output.
    """
    layers = list(layers)
    if not layers:
        return input_data
    first = layers[0]
    states = [_state(layer) for layer in layers]
    names = list(states[0])
    for k, state in enumerate(states[1:], 1):
        if list(state) != names:
            raise ValueError(f"scan_layers: layer {k} has mismatched keys with layer 0: "
                             f"{sorted(set(state) ^ set(names))}")
        for name in names:
            a, b = states[0][name], state[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"scan_layers: Shape mismatch for {name!r}: layer 0 has {list(a.shape)} {a.dtype}, "
                                 f"layer {k} has {list(b.shape)} {b.dtype}")
    stacked = {name: torch.stack([s[name] for s in states]) for name in names}
    key = (id(partition_fn), id(first))
    step = _ONE_LAYER_CACHE.get(key) if is_layer_pure else None
    if step is None:
        step = _one_layer(first, isinstance(input_data, tuple))
        if is_layer_pure:
            _ONE_LAYER_CACHE[key] = step
    out, _ = scan(step, input_data, stacked, partition_fn=partition_fn, is_fn_pure=is_layer_pure)
    return out


def _one_layer(layer: nn.Module, unpack: bool) -> Callable:
    def step(carry, state):
        args = tuple(carry) if unpack else (carry,)
        out = torch.func.functional_call(layer, state, args)
        return (tuple(out) if unpack else out), None
    return step
