"""Why a graph compiled again: each compile after the first is compared with the closest
graph compiled before at the same barrier (the same line of user code), its cause
classified and a remedy suggested. Called by the debugging analysis (`analysis.py`) at
compiles only, never on a cached run; host reads that cut a step's graph are noted at
their runs (a frame walk, on the host-read path only) so that the graph after the cut can
be blamed on them.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Dict, List, Optional

# cause -> (label, suggestion)
CAUSES: Dict[str, tuple] = {
    "shape": ("input shape drift",
              "pad inputs to a few fixed sizes (buckets), or mark the varying dimension dynamic "
              "(torch_xla._XLAC._xla_mark_dynamic)"),
    "dtype": ("dtype change",
              "cast the inputs to one dtype before the step, so that every step traces the same types"),
    "data_dependent": ("data-dependent op",
                       "its output size depends on the values (a host sync cuts the graph and each new size "
                       "compiles): use a fixed-size form (torch.where, masked_fill, nonzero_static) or keep it "
                       "on the device with bounded shapes (XLA_EXPERIMENTAL=nonzero:masked_select)"),
    "host_read": ("host read cut the graph",
                  "move .item() / .cpu() / print / `if t:` out of the loop (after torch_xla.sync()), or keep "
                  "the value on the device (torch.where instead of `if t:`)"),
    "python_value": ("Python value baked into the graph",
                     "a Python number or argument that changes between steps is compiled in as a constant: "
                     "pass it as a device tensor (torch.tensor(v, device=...)) or keep it fixed"),
    "rng": ("random-state use changed",
            "use the same random ops in every step (dropout with p=0 rather than skipping it; one generator "
            "and seeding outside the loop)"),
    "code_path": ("different code path",
                  "the traced Python took another branch: keep the step's control flow fixed (torch.where "
                  "instead of a Python `if` on a changing value)"),
}

# Ops whose output size depends on their input values: on the CPU fallback, their input
# is read on the host first (`kernels/fallback.py`).
DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2",
                            "unique_dim", "unique_consecutive", "repeat_interleave", "masked_scatter",
                            "bincount", "nms"})
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "exponential", "cauchy",
           "geometric", "log_normal", "poisson", "random")

_explained: List[dict] = []
_MAX = 256
_counts: Counter = Counter()
_step_cuts: List[tuple] = []    # (cause, op or None, line) of this step's host reads


def reset() -> None:
    _explained.clear()
    _counts.clear()
    _step_cuts.clear()


def explanations() -> List[dict]:
    return list(_explained)


def counts() -> Dict[str, int]:
    return dict(_counts)


def cut_kind() -> tuple:
    """(cause, op) of the host read running now: the data-dependent op whose CPU fallback
    reads its input, or a plain host read."""
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_name == "cpu_fallback" and code.co_filename.endswith("fallback.py"):
            op = _op_name(f.f_locals.get("op"))
            if op in DATA_DEPENDENT or (op == "index" and _bool_index(f.f_locals.get("args"))):
                return "data_dependent", op
            return "host_read", op
        f = f.f_back
    return "host_read", None


def _op_name(op) -> str:
    name = getattr(op, "__name__", None) or str(op)
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]


def _bool_index(args) -> bool:
    import torch
    if not args or len(args) < 2:
        return False
    idx = args[1]
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in (idx or ()))


def host_read(line: str) -> None:
    """A host read ran a pending graph in this step (called at its run)."""
    cause, op = cut_kind()
    _step_cuts.append((cause, op, line))


def step() -> None:
    _step_cuts.clear()


def _is_random(desc: tuple) -> bool:
    op = desc[0]
    return op.startswith("aten::") and any(r in op for r in _RANDOM)


def classify(changes: List[tuple], cut: Optional[tuple]) -> tuple:
    """(cause, detail) from the differences with the closest earlier graph: `changes` are
    (kind, old desc, new desc) with kind in op / argument / constant / dtype / shape /
    added / removed; `cut`: (cause, op, line) when this graph was run by a host read."""
    if cut is not None:
        cause, op, line = cut
        if cause == "data_dependent":
            return cause, f"`{op}` read its input on the host to size its output ({line})"
        return cause, f"the pending graph ran for a host read{f' by the CPU fallback of {op}' if op else ''} ({line})"
    inputs_reshaped = any(k == "shape" and n[0] in ("input", "scalar input") for k, _, n in changes)
    if _step_cuts and inputs_reshaped:
        dd = [c for c in _step_cuts if c[0] == "data_dependent"]
        cause, op, line = (dd or _step_cuts)[-1]
        if cause == "data_dependent":
            return cause, f"the shape of an input comes from `{op}` ({line}), sized by its values"
        return cause, f"a host read ({line}) cut the step: this graph is its remainder"
    for k, o, n in changes:
        if (o is not None and _is_random(o)) or (n is not None and _is_random(n)):
            if k != "shape" and k != "dtype":
                return "rng", f"random op {(n or o)[0]} {'added' if k == 'added' else 'removed' if k == 'removed' else 'changed'}"
    for k, o, n in changes:
        if k == "dtype":
            return "dtype", f"{_short(o)}  =>  {_short(n)}"
    for k, o, n in changes:
        if k == "shape":
            return "shape", f"{_short(o)}  =>  {_short(n)}"
    for k, o, n in changes:
        if k in ("argument", "constant") or any(d is not None and d[0] in ("constant", "scalar input")
                                                 for d in (o, n)):
            return "python_value", f"{_short(o)}  =>  {_short(n)}"
    if _step_cuts:
        cause, op, line = _step_cuts[-1]
        return cause, f"a host read ({line}) cut the step: this graph is its remainder"
    first = changes[0] if changes else None
    return "code_path", (f"{first[0]}: {_short(first[1])}  =>  {_short(first[2])}" if first else "")


def _short(d: Optional[tuple]) -> str:
    if d is None:
        return "nothing"
    op, ins, outs, st = d
    if op in ("input", "scalar input"):
        return f"{op} {outs}"
    if op == "constant":
        return f"constant {outs} = {st}"
    text = f"{op}({ins}) -> {outs}" + (f" with {st}" if st else "")
    return text if len(text) <= 120 else text[:117] + "..."


def record(cause: str, detail: str, graph_hash: str, closest: Optional[str], site: str) -> dict:
    label, suggestion = CAUSES[cause]
    entry = {"cause": cause, "label": label, "suggestion": suggestion, "detail": detail,
             "graph": graph_hash, "closest": closest, "site": site}
    _counts[cause] += 1
    _explained.append(entry)
    del _explained[:-_MAX]
    return entry


def lines(entry: dict) -> List[str]:
    """The analysis block's lines for one explained compile."""
    return [f"Recompilation Cause: {entry['label']} ({entry['cause']}): {entry['detail']}",
            f"  Suggestion: {entry['suggestion']}"]


def report() -> str:
    """The causes of the compiles explained so far, most frequent first, with a suggestion each."""
    if not _counts:
        return "Recompilations: none explained\n"
    out = [f"Recompilations: {sum(_counts.values())} explained"]
    for cause, n in _counts.most_common():
        label, suggestion = CAUSES[cause]
        last = next(e for e in reversed(_explained) if e["cause"] == cause) if _explained else None
        where = f" (last at {last['site']}: {last['detail']})" if last else ""
        out.append(f"  {n} x {label} [{cause}]{where}")
        out.append(f"      suggestion: {suggestion}")
    return "\n".join(out) + "\n"
