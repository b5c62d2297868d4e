"""The package's structure and its promises: layering, the patch registry, the env-var
registry, the kernels' fast path, and the calls that must hold or fail loudly."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla._engine import env_vars, patches
from torch_xla._engine.kernels import KERNELS
from torch_xla._engine.tensor import unwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "torch_xla"


def _modules():
    return sorted(p for p in PKG.rglob("*.py"))


def test_no_import_cycle_among_torch_xla_modules():
    import grimp
    graph = grimp.build_graph("torch_xla")
    mods = sorted(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in mods}
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    sys.setrecursionlimit(10000)
    for m in mods:
        if m not in index:
            visit(m)
    cycles = [sorted(c) for c in sccs if len(c) > 1]
    # A package and its own submodules (`pkg/__init__` importing `pkg.sub`) are not cycles
    # unless a submodule imports the package back; grimp reports those too, so none is allowed.
    assert cycles == [], cycles


def test_torch_library_only_under_kernels_and_environ_only_in_config():
    for p in _modules():
        text = p.read_text()
        rel = p.relative_to(REPO).as_posix()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("#", "`", '"')))
        if re.search(r"\btorch\.library\.", code):
            assert rel.startswith("torch_xla/_engine/kernels/"), rel
        if "os.environ" in code or "os.getenv" in code:
            assert rel == "torch_xla/_engine/env_vars.py", rel


def test_no_module_over_800_lines():
    long = {p.relative_to(REPO).as_posix(): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > 800}
    assert long == {}


def test_architecture_doc_lists_every_patch_and_readme_every_variable():
    arch = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    assert patches.markdown() in arch, "regenerate with: python -m torch_xla._engine.patches"
    readme = (REPO / "README.md").read_text()
    assert env_vars.table() in readme, "regenerate with: python -c 'from torch_xla._engine import env_vars; print(env_vars.table())'"


_META_ERRORS = r"""
import sys, torch
if sys.argv[1] == "1":
    import torch_xla
cases = [
    lambda: torch.empty(2, 3, device="meta").add_(torch.empty(4, 3, device="meta")),
    lambda: torch.empty(3, dtype=torch.long, device="meta").mul_(1.5),
    lambda: torch.empty(3, dtype=torch.long, device="meta").div_(torch.empty(3, device="meta")),
    lambda: torch.empty(2, device="meta").addcmul_(torch.empty(3, device="meta"), torch.empty(3, device="meta")),
    lambda: torch.empty(2, device="meta").lerp_(torch.empty(2, 2, device="meta"), 0.5),
    lambda: torch.empty(2, 2, device="meta").add_(torch.empty(2, device="meta")).shape,
]
for c in cases:
    try:
        print("OK", c())
    except Exception as e:
        print(type(e).__name__, e)
"""


def test_cpu_meta_tensors_behave_as_without_torch_xla():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    runs = [subprocess.run([sys.executable, "-c", _META_ERRORS, flag], capture_output=True, text=True,
                           timeout=300, env=env) for flag in ("0", "1")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout
    assert runs[0].stdout.count("RuntimeError") >= 4


def test_xla_inplace_errors_raise_at_the_op_every_time():
    # The lean meta check remembers only combinations that passed: a failing one raises
    # PyTorch's meta-kernel error at every call, as on the CPU.
    for a, b in [(torch.ones(2, 3), torch.ones(4, 3)), (torch.ones(3, dtype=torch.long), torch.ones(3))]:
        with pytest.raises(RuntimeError):
            a.clone().add_(b)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="broadcast|cast|size"):
                a.to(xm.xla_device()).add_(b.to(xm.xla_device()))


# ---- the specialised kernels: same node as the generic kernel, and taken ---------------------

def _calls():
    d = xm.xla_device()
    a, b = torch.randn(3, 4, device=d), torch.randn(3, 4, device=d)
    c = torch.randn(4, device=d)
    return [
        # (overload, dispatcher call, direct call on inner tensors)
        ("add.Tensor", lambda: torch.add(a, b, alpha=2.5), lambda ia, ib, ic: ((ia, ib), {"alpha": 2.5})),
        ("add.Tensor", lambda: a + b, lambda ia, ib, ic: ((ia, ib), {})),               # alpha left at 1
        ("add.Tensor", lambda: a + 1.0, lambda ia, ib, ic: ((ia, 1.0), {})),            # a constant
        ("add.Tensor", lambda: a + (-0.0), lambda ia, ib, ic: ((ia, -0.0), {})),         # a parameter
        ("mul.Tensor", lambda: a * 0.25, lambda ia, ib, ic: ((ia, 0.25), {})),           # wrapped number
        ("relu.default", lambda: torch.relu(a), lambda ia, ib, ic: ((ia,), {})),
        ("mm.default", lambda: a @ b.t(), None),
        ("mul.Tensor", lambda: a * b, lambda ia, ib, ic: ((ia, ib), {})),
        ("sum.dim_IntList", lambda: a.sum(1, keepdim=True), lambda ia, ib, ic: ((ia, [1], True), {})),
        ("addcmul.default", lambda: torch.addcmul(a, b, c, value=0.3),
         lambda ia, ib, ic: ((ia, ib, ic), {"value": 0.3})),
        ("clamp.Tensor", lambda: torch.clamp(a, min=b), lambda ia, ib, ic: ((ia, ib, None), {})),
        ("div.Tensor_mode", lambda: torch.div(a, b, rounding_mode="floor"), None),
        ("pow.Tensor_Scalar", lambda: a.abs() ** 1.7, None),
        ("where.self", lambda: torch.where(a > 0, a, b), None),
    ]


def test_specialised_kernel_is_taken_and_builds_the_generic_node():
    d = xm.xla_device()
    a, b, c = torch.randn(3, 4, device=d), torch.randn(3, 4, device=d), torch.randn(4, device=d)
    ia, ib, ic = unwrap(a), unwrap(b), unwrap(c)
    for name, call, direct in _calls():
        k = KERNELS[name]
        call()  # first call: the generic kernel fills the shape entry and generates the fast kernel
        assert k.fast is not None, name
        generic_calls = []
        real_generic = k.fast.__globals__["generic"]

        def spy(*args, **kwargs):
            generic_calls.append(name)
            return real_generic(*args, **kwargs)

        k.fast.__globals__["generic"] = spy
        try:
            call()
        finally:
            k.fast.__globals__["generic"] = real_generic
        assert generic_calls == [], f"{name}: the second call left the fast path"
        if direct is not None:
            args, kwargs = direct(ia, ib, ic)
            fast, generic = k.fast(*args, **kwargs), k(*args, **kwargs)
            fn, gn = fast._xla.node, generic._xla.node
            assert fn.hash == gn.hash and fn.args == gn.args and fn.avals == gn.avals, name
            from torch_xla._engine import ir

            def operands(n):  # scalar parameters are new leaves per call: compare their values
                return [(o.value, o.avals) if type(o) is ir.ScalarParam else id(o) for o, _ in n.operands]
            assert operands(fn) == operands(gn), name
    xm.mark_step()


def test_every_specialisable_kernel_is_generated_from_its_steps():
    from torch_xla._engine.kernels.specialise import specialisable, specialise
    made = [name for name, k in KERNELS.items() if specialisable(k) and callable(specialise(k))]
    assert len(made) > 400


_PRINT_KERNELS = r"""
import torch, torch_xla
a = torch.ones(2, 2, device=torch_xla.device())
for _ in range(2):
    b = torch.relu(a + a) @ a
print(b.cpu().sum().item())
"""


def test_print_kernels_prints_the_source_of_the_kernels_it_names():
    from torch_xla._engine.kernels.specialise import _printed
    env = dict(os.environ, PJRT_DEVICE="CPU", PT_XLA_PRINT_KERNELS="aten::add.Tensor, mm")
    r = subprocess.run([sys.executable, "-c", _PRINT_KERNELS], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "16.0"
    a = torch.ones(2, 2, device=xm.xla_device())
    for _ in range(2):
        torch.relu(a + a) @ a  # the same kernels, generated in this process
    for name in ("add.Tensor", "mm.default"):
        k = KERNELS[name]
        assert r.stderr.count(f"# <kernel {k.name}>:") == 1, name
        assert k.fast.source in r.stderr, name
    assert "<kernel aten::relu" not in r.stderr
    with env_vars.overlay({"PT_XLA_PRINT_KERNELS": "1"}):
        assert _printed("aten::relu")
    with env_vars.overlay({"PT_XLA_PRINT_KERNELS": "add, aten::mm.default"}):
        assert _printed("aten::add.Tensor") and _printed("aten::add.Scalar") and _printed("aten::mm")
        assert not _printed("aten::addmm")
    assert not _printed("aten::add.Tensor")
    xm.mark_step()


def test_lowering_apply_rejects_a_wrong_shape():
    import numpy as np
    from torch_xla._engine.lowering import Lowering, LoweringError, apply
    low = Lowering("test::bad", lambda x: x.sum(), False, (), None, False)
    with pytest.raises(LoweringError, match="produced shape"):
        apply(low, (np.ones((2, 3), np.float32),), [((2, 3), np.dtype(np.float32))])


# ---- promises: hold or fail loudly -------------------------------------------------------------

def test_xlac_is_an_attribute_after_import_torch_xla():
    code = ("import torch, torch_xla\n"
            "t = torch.ones(2, device=torch_xla.device()) * 3\n"
            "print(torch_xla._XLAC._get_xla_tensors_text([t]).splitlines()[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "IR {"


def test_second_device_in_one_process_fails_loudly():
    code = ("import torch, torch_xla\n"
            "assert len(torch_xla.devices()) == 2\n"
            "for f in (lambda: torch.ones(2, device=torch_xla.device(1)), lambda: torch.ones(2).to('xla:1')):\n"
            "    try:\n"
            "        f(); print('silent')\n"
            "    except RuntimeError as e:\n"
            "        print('raised', 'xla:0' in str(e))\n"
            "print(torch.ones(2, device=torch_xla.device(0)).cpu().tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["raised True", "raised True", "[1.0, 1.0]"]
    with pytest.raises(IndexError, match="out of range"):
        torch_xla.device(7)


def test_compile_counts_different_graphs():
    f = torch_xla.compile(lambda x: (x * 2 + 1).sum(), num_different_graphs_allowed=1)
    d = xm.xla_device()
    assert f(torch.ones(3, device=d)).item() == 9.0
    assert f(torch.full((3,), 2.0, device=d)).item() == 15.0   # same graph, new data
    with pytest.raises(RuntimeError, match="num_different_graphs_allowed=1"):
        f(torch.ones(5, device=d))
    xm.mark_step()


def test_capture_runs_the_traced_program_on_new_inputs():
    from torch_xla._engine.capture import capture
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    d = xm.xla_device()
    dlin = torch.nn.Linear(4, 3).to(d)
    dlin.load_state_dict(lin.state_dict())

    def f(x, acc):
        acc.add_(x.sum(0))                      # an input written in place
        return {"y": torch.relu(dlin(x)) * 0.5, "n": (x * x).sum()}

    x0, acc0 = torch.randn(5, 4), torch.zeros(4)
    xd, accd = x0.to(d), acc0.to(d)
    prog = capture(f, xd, accd)
    assert torch.allclose(accd.cpu(), x0.sum(0))          # the traced call's own write-back
    assert prog.mutated == [1]
    x1 = torch.randn(5, 4)
    x1d = x1.to(d)
    out = prog.run(x1d, accd)
    assert torch.allclose(out["y"].cpu(), torch.relu(lin(x1)) * 0.5, atol=1e-6)
    assert torch.allclose(out["n"].cpu(), (x1 * x1).sum(), rtol=1e-5)
    assert torch.allclose(accd.cpu(), x0.sum(0) + x1.sum(0), atol=1e-6)
    assert "stablehlo" in prog.lowered().as_text() or "func.func" in prog.lowered().as_text()
    with pytest.raises(ValueError, match="aval"):
        prog.run(torch.randn(6, 4).to(d), accd)


def test_specialised_kernel_records_sources_and_index_check_lines():
    """The common case makes its node inline: it still records the user's line while
    sources are recorded, and the line of an index-checked op."""
    from torch_xla._engine import ir
    d = xm.xla_device()
    a, b = torch.randn(3, 4, device=d), torch.randn(3, 4, device=d)
    idx = torch.tensor([0, 2], device=d)
    for _ in range(2):  # the second call takes the fast path
        s = a + b
        sel = torch.index_select(a, 0, idx)
    assert KERNELS["add.Tensor"].fast is not None and KERNELS["index_select.default"].fast is not None
    line = sys._getframe().f_lineno + 3
    ir.record_sources(True)
    try:
        s = a + b
    finally:
        ir.record_sources(False)
    assert ir.SOURCES[unwrap(s)._xla.node] == f"test_architecture.py:{line}"
    sel = torch.index_select(a, 0, idx)
    assert ir.CHECK_SOURCES[unwrap(sel)._xla.node].endswith(f"test_architecture.py:{line + 4}")
    assert torch.equal(sel.cpu(), torch.index_select(a.cpu(), 0, idx.cpu()))
    xm.mark_step()


_GC_DURING_IMPORTS = r"""
import gc, sys
import torch
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
if sys.argv[1] == "off":
    gc.disable()
import torch_xla
after_xla = (len(full), gc.isenabled())
import torch._dynamo
print(after_xla[0], after_xla[1], len(full) - after_xla[0], gc.isenabled(), gc.get_freeze_count() > 0)
"""


@pytest.mark.parametrize("tune", ["1", pytest.param("0", marks=pytest.mark.slow)])   # fresh processes, ~4 s each
@pytest.mark.parametrize("state", ["on", "off"])
def test_collector_paused_during_imports_and_restored(tune, state):
    # `quiet_gc_imports`: no full collection inside `import torch_xla` nor inside the import
    # of torch._dynamo, what they made is frozen after, and the collector's state is the
    # program's. With PT_XLA_TUNE_GC=0 full passes run during both imports (which shows the
    # test sees them) and nothing is frozen.
    env = dict(os.environ, PJRT_DEVICE="CPU", PT_XLA_TUNE_GC=tune)
    r = subprocess.run([sys.executable, "-c", _GC_DURING_IMPORTS, state], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    n_xla, on_after_xla, n_dynamo, on_after_dynamo, frozen = r.stdout.split()
    assert on_after_xla == on_after_dynamo == str(state == "on")
    assert frozen == str(tune == "1" and state == "on")
    if tune == "1" or state == "off":
        assert (n_xla, n_dynamo) == ("0", "0")
    else:
        assert int(n_xla) > 0 and int(n_dynamo) > 0
