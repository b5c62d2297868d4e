"""IR debugging (XLA_IR_DEBUG / XLA_HLO_DEBUG): the profiler scope and the Python frames
recorded at each node's creation (`ir.DEBUG_INFO`), as the texts show them: `Frames:` and
`scope=<name>.<n>` in the IR text (`_xla_tensors_report`, `_get_xla_tensors_text`), the scope as the
outer name scope of an op's HLO metadata. Without those variables nothing is recorded and
these functions find nothing."""
from __future__ import annotations

from typing import List, Optional

from .. import ir


def scope_of(node: ir.Node) -> str:
    """The profiler `Trace` scope (`name.N`, nested with `/`) open when `node` was made, or ''."""
    info = ir.DEBUG_INFO.get(node) if ir.DEBUG_INFO else None
    return info[0] if info else ""


def frames_text(order: List[ir.Node]) -> Optional[str]:
    """`Frames:` and the recorded frames of the last node of `order` that has them."""
    if not ir.DEBUG_INFO:
        return None
    for n in reversed(order):
        info = ir.DEBUG_INFO.get(n)
        if info and info[1]:
            return "Frames:\n" + "".join(f"  {name} ({path}:{line})\n" for name, path, line in info[1])
    return None


def hlo_scope(node: ir.Node, source: Optional[str]) -> Optional[str]:
    """The name scope of `node`'s operations in the HLO metadata (`op_name`): its profiler
    scope, then its source line (either may be missing)."""
    scope = scope_of(node)
    if scope and source:
        return f"{scope}/{source}"
    return scope or source
