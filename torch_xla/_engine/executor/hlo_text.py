"""XLA HLO text in the form PyTorch/XLA prints it: entry parameters named `p<N>`, one
instruction id counter for the whole module (`%p0.1`, `%custom-call.2`), and device lists
written out (`{devices=[4,1]0,1,2,3}`, as `_get_xla_sharding_spec` writes them) instead of
XLA's iota shorthand (`{devices=[4,1]<=[4]}`)."""
from __future__ import annotations

import re
from typing import Dict, List

import numpy as np

_INSTR = re.compile(r"^(\s*(?:ROOT )?)%([\w.\-]+) = (.*)$")
_PARAM = re.compile(r"\bparameter\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY )?%[\w.\-]+ \((.*)\) -> .* \{$")
_REF = re.compile(r"%([\w.\-]+)")
_IOTA = re.compile(r"devices=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_SUFFIX = re.compile(r"\.\d+$")
_OPCODE = re.compile(r" ([a-z][\w\-]*)\(")


def _expand_iota(m: "re.Match") -> str:
    reshape = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(reshape))).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(p) for p in m.group(3).split(",")])
    return f"devices=[{m.group(1)}]" + ",".join(map(str, ids.flatten().tolist()))


def _opcode(rest: str) -> str:
    """The opcode of an instruction from the text after its `=` (a shape, maybe a tuple's)."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                break
    m = _OPCODE.match(rest, rest.find(" ", i))
    return m.group(1) if m else ""


def _new_names(lines: List[str], by_opcode: bool) -> Dict[str, str]:
    """Old instruction name -> new one, ids counted in print order over the module."""
    names: Dict[str, str] = {}
    entry = False
    for line in lines:
        h = _HEADER.match(line)
        if h:
            entry = bool(h.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        old, rest = m.group(2), m.group(3)
        p = _PARAM.search(rest)
        if entry and p:
            base = f"p{p.group(1)}"
        else:
            base = (by_opcode and _opcode(rest)) or _SUFFIX.sub("", old)
        names[old] = f"{base}.{len(names) + 1}"
    return names


def original_form(text: str, by_opcode: bool = False) -> str:
    """`text` (an HloModule's text) with the original project's names and device lists;
    `by_opcode`: every instruction named by its opcode (`%custom-call.3`), as the
    original's builder names them, instead of by the jax primitive that emitted it."""
    lines = text.split("\n")
    names = _new_names(lines, by_opcode)

    def ref(m: "re.Match") -> str:
        return "%" + names.get(m.group(1), m.group(1))

    def header_param(m: "re.Match") -> str:
        return names.get(m.group(1), m.group(1)) + ":"

    out = []
    for line in lines:
        if _HEADER.match(line):
            head, sep, tail = line.partition("(")
            params, close, rest = tail.partition(") -> ")
            line = head + sep + re.sub(r"([\w.\-]+):", header_param, params) + close + rest
        else:
            line = _REF.sub(ref, line)
        out.append(_IOTA.sub(_expand_iota, line))
    return "\n".join(out)


def module_text(proto: bytes) -> str:
    """A serialized `HloModuleProto` as text in the original's form, operand shapes
    inline and instructions named by opcode."""
    from jaxlib import xla_client
    module = xla_client.XlaComputation(proto).as_hlo_module()
    return original_form(module.to_string(_print_options(False)), by_opcode=True)


def _print_options(metadata: bool):
    from jaxlib import xla_client
    opts = xla_client.hlo.HloPrintOptions()
    opts.print_large_constants = True
    opts.print_operand_shape = True
    opts.print_metadata = metadata
    return opts


def optimized_graph(graph, strategy) -> str:
    """A walked graph's program after XLA's optimization passes (in SPMD mode partitioned:
    each device's piece, with the collectives the partitioner inserted), in the original's
    form: the executable that runs the graph if one was compiled, otherwise one compiled
    now (nothing runs). With XLA_HLO_DEBUG, with each instruction's metadata."""
    from .. import env_vars
    from . import compile as compiling
    exe = compiling.lookup(graph.key, tuple(range(len(graph.params))))
    compiled = getattr(exe, "compiled", None)
    if not hasattr(compiled, "runtime_executable"):
        compiled = compiling.lowered(graph, strategy).compile()
    module = compiled.runtime_executable().hlo_modules()[0]
    return original_form(module.to_string(_print_options(bool(env_vars.get("XLA_HLO_DEBUG")))))
