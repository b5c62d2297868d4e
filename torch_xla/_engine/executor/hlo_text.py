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


def _expand_iota(m: "re.Match") -> str:
    reshape = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(reshape))).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(p) for p in m.group(3).split(",")])
    return f"devices=[{m.group(1)}]" + ",".join(map(str, ids.flatten().tolist()))


def _new_names(lines: List[str]) -> Dict[str, str]:
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
        base = f"p{p.group(1)}" if entry and p else _SUFFIX.sub("", old)
        names[old] = f"{base}.{len(names) + 1}"
    return names


def original_form(text: str) -> str:
    """`text` (an HloModule's text) with the original project's names and device lists."""
    lines = text.split("\n")
    names = _new_names(lines)

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
