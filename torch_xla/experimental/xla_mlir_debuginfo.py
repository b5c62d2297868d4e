"""Debug information in the exported StableHLO: `torch.ops.xla.write_mlir_debuginfo(x, data)`.

On the xla device the op returns `x` and records `data` on the operation that computed
`x`; the StableHLO text of an export (`StableHLOGraphModule.get_stablehlo_text`) gives
that operation the location `loc("<data>")`. Elsewhere (CPU, `torch.export` tracing) it
is a copy of `x`. `StableHLOExportOptions.export_node_metadata` writes each FX node's
metadata this way.

The data travels as a name scope of the operation's lowering (hex-encoded, so any text
survives jax's name stack) that `locations_text` turns into the location.
"""
from __future__ import annotations

import re

import torch

from .._engine import ir
from .._engine.kernels import library
from .._engine.tensor import make_tensor, state_of, wrap_user

__all__ = ["write_mlir_debuginfo", "annotate", "locations_text"]

_MARK = "xla_mlir_debuginfo-"


def annotate(t: torch.Tensor, data: str) -> None:
    """Records `data` on the pending operation that computes xla tensor `t` (inputs and
    values already computed have no operation: nothing to record)."""
    node = state_of(t).node
    if type(node) is ir.Node:
        ir.SOURCES[node] = _MARK + data.encode("utf-8").hex()


def _xla(x: torch.Tensor, data: str) -> torch.Tensor:
    annotate(x, data)
    s = state_of(x)
    return wrap_user(make_tensor(s.node, s.idx, tuple(x.shape), x.dtype))


def _elsewhere(x: torch.Tensor, data: str) -> torch.Tensor:  # noqa: ARG001  (the op's schema)
    return x.clone()


def _meta(x: torch.Tensor, data: str) -> torch.Tensor:  # noqa: ARG001  (the op's schema)
    return torch.empty_like(x)


if not hasattr(torch.ops.xla, "write_mlir_debuginfo"):
    library.define("xla", "write_mlir_debuginfo(Tensor x, str data) -> Tensor")
    library.impl_ns("xla", "write_mlir_debuginfo", _xla, "PrivateUse1")
    library.impl_ns("xla", "write_mlir_debuginfo", _elsewhere, "CompositeExplicitAutograd")
    library.impl_ns("xla", "write_mlir_debuginfo", _meta, "Meta")


def write_mlir_debuginfo(x: torch.Tensor, data: str) -> torch.Tensor:
    """`x`, with `data` as the MLIR location of the operation that computed it."""
    return torch.ops.xla.write_mlir_debuginfo(x, data)


def _mlir_string(s: str) -> str:
    out = []
    for b in s.encode("utf-8"):
        c = chr(b)
        out.append(c if 0x20 <= b < 0x7f and c not in '"\\' else f"\\{b:02X}")
    return '"' + "".join(out) + '"'


_ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)$", flags=re.M)


def locations_text(text: str) -> str:
    """Module text printed with its locations: each location that carries recorded data
    becomes `loc("<data>")` on the operation's own line (the innermost data when scopes
    nest); the other locations stay as they are."""
    if _MARK not in text:
        return text
    defs = {m.group(1): m.group(2) for m in _ALIAS.finditer(text)}
    found: dict = {}

    def resolve(body: str, depth: int = 0):
        hits = re.findall(_MARK + r"([0-9a-f]*)", body)
        if hits:
            return hits[-1]
        if depth > 32:
            return None
        for ref in re.findall(r"#loc\d*", body):
            if ref in defs:
                r = found.get(ref, False)
                if r is False:
                    r = found[ref] = resolve(defs[ref], depth + 1)
                if r is not None:
                    return r
        return None

    def replace(m: re.Match) -> str:
        hexdata = resolve(m.group(1))
        if hexdata is None:
            return m.group(0)
        return "loc(" + _mlir_string(bytes.fromhex(hexdata).decode("utf-8", "replace")) + ")"

    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("#loc"):
            continue
        lines[i] = re.sub(r"loc\(((?:#loc\d*)|(?:\"[^\"]*\"[^)]*))\)\s*$", replace, line)
    return "\n".join(lines)
