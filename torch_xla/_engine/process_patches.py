"""The install functions of the registry's generic entries (`patches.REGISTRY`): changes to
`torch.nn`, TorchDynamo, the autograd engine, jax's options and Python's garbage collector
that belong to no other module. Each is called once, by `patches.install`; one that finds
PyTorch looking different leaves it alone with a warning and returns False.
"""
from __future__ import annotations

import sys
import threading
import types

import torch

from . import collector, patches


# ---- module_apply ---------------------------------------------------------------------------

_orig_apply = torch.nn.Module._apply
_tls = threading.local()


def _apply(self, fn, recurse=True):
    if getattr(_tls, "active", False) or not recurse:
        return _orig_apply(self, fn, recurse)
    holders = {}
    for mod in self.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, name))
    _tls.active = True
    try:
        out = _orig_apply(self, fn, recurse)
    finally:
        _tls.active = False
    for refs in holders.values():
        if len(refs) < 2:
            continue
        mod0, name0 = refs[0]
        first = mod0._parameters[name0]
        if first is None or first.device.type != "xla":
            continue
        for mod, name in refs[1:]:
            if mod._parameters[name] is not first:
                mod._parameters[name] = first
    return out


def install_module_apply() -> bool:
    """`module_apply`."""
    if not patches.signature_matches(_orig_apply, ["self", "fn", "recurse"], "torch.nn.Module._apply"):
        return False
    torch.nn.Module._apply = _apply
    return True


def enable_x64() -> None:
    """`jax_x64`: imports jax (after `xla_flags` and `retain_host_memory`, which must precede it)."""
    import jax
    jax.config.update("jax_enable_x64", True)


def install_dynamo_skips() -> None:
    """`dynamo_skips_engine`: now if torch._dynamo is loaded, else once it loads."""
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is not None:
        _skip_engine(rules)
    elif not any(isinstance(f, _AfterTraceRules) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTraceRules())


def _skip_engine(rules) -> None:
    for name in ("torch_xla._engine", "torch_xla._XLAC", "torch_xla.distributed.spmd", "jax", "jaxlib",
                 "ml_dtypes"):
        rules.add(name)
    # The specialised kernels are generated code named "<kernel aten::...>" (kernels/specialise.py):
    # no module directory covers them, so their file-name prefix is skipped too.
    dirs = getattr(rules, "SKIP_DIRS", None)
    if isinstance(dirs, list) and hasattr(rules, "_recompile_re") and "<kernel " not in dirs:
        dirs.append("<kernel ")
        rules._recompile_re()


class _OneShotImportHook:
    """A one-shot import hook: wraps the loading of module `NAME` with `around(run, module)`."""
    NAME = ""

    def around(self, run, module) -> None:
        run(module)

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: self.around(run, module)
        return spec


class _AfterTraceRules(_OneShotImportHook):
    """Runs `_skip_engine` right after torch._dynamo.trace_rules loads."""
    NAME = "torch._dynamo.trace_rules"

    def around(self, run, module) -> None:
        run(module)
        _skip_engine(module)


# ---- quiet_gc_imports ---------------------------------------------------------------------------
# (`import torch_xla` pauses the collector itself, around everything it imports: torch_xla/__init__.py.)

class _QuietDynamoImport(_OneShotImportHook):
    """Runs torch._dynamo's import (torch.optim's first step or torch.compile does it) with
    the collector paused: its full passes rescanned torch's import-time objects."""
    NAME = "torch._dynamo"

    def around(self, run, module) -> None:
        with collector.paused():
            run(module)


def install_quiet_dynamo_import() -> None:
    """`quiet_gc_imports` for torch._dynamo (when it is not imported yet)."""
    if ("torch._dynamo" not in sys.modules
            and not any(isinstance(f, _QuietDynamoImport) for f in sys.meta_path)):
        sys.meta_path.insert(0, _QuietDynamoImport())


# ---- inline_backward ----------------------------------------------------------------------------

class _InlineBackwardEngine:
    """Stands for PyTorch's autograd engine object: `run_backward` runs with the engine's
    multithreading off (a thread-local flag, restored after), everything else is the engine's."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        was = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(was)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install_inline_backward() -> bool:
    """`inline_backward`."""
    from torch.autograd.variable import Variable
    engine = Variable._execution_engine
    if isinstance(engine, _InlineBackwardEngine):
        return True
    if not (hasattr(engine, "run_backward") and hasattr(torch._C, "_set_multithreading_enabled")):
        return patches.refuse("the autograd engine", "it looks different; a backward on a device other "
                              "than xla:0 may fail")
    Variable._execution_engine = _InlineBackwardEngine(engine)
    return True


# ---- tune_gc ----------------------------------------------------------------------------------

def tune_gc() -> None:
    """The import-time objects move to the permanent generation (`gc.freeze()`;
    refcounting still frees them) and the youngest generation collects every 10,000 net
    allocations instead of 700; a threshold the program already changed is kept."""
    import gc
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    if t0 == 700:
        gc.set_threshold(10000, t1, t2)


# ---- lazy_dynamo_disable ----------------------------------------------------------------------
# Many of PyTorch's meta kernels are Python references wrapped by `torch._disable_dynamo`,
# whose wrapper imports torch._dynamo on the first call (1-2 s here) to build a
# "don't trace this" version of the function, cached as `fn.__dynamo_disable`. While
# torch._dynamo is not imported nothing can be tracing, so calling `fn` directly is the
# same. Each wrapped function gets a stand-in that does that, and hands over to the real
# wrapper once torch._dynamo has been imported (by the user, torch.compile or torch.optim).

class _UntilDynamo:
    __slots__ = ("fn", "recursive")

    def __init__(self, fn, recursive):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        dyn = sys.modules.get("torch._dynamo")
        if dyn is None or not hasattr(dyn, "disable"):
            return self.fn(*args, **kwargs)
        real = dyn.disable(self.fn, self.recursive, wrapping=False)
        setattr(self.fn, "__dynamo_disable", real)  # (a plain assignment here would be name-mangled)
        return real(*args, **kwargs)


def lazy_dynamo_disable() -> bool:
    """Gives every `torch._disable_dynamo` wrapper the stand-in above (nothing to do when
    torch._dynamo is already imported). It finds them among the collector's objects, before
    `gc.freeze()` would hide them."""
    if "torch._dynamo" in sys.modules:
        return True
    try:
        code = torch._compile._disable_dynamo(lambda: None).__code__
        i_fn, i_rec = code.co_freevars.index("fn"), code.co_freevars.index("recursive")
    except (AttributeError, ValueError):  # another torch: leave it alone
        return patches.refuse("torch._disable_dynamo", "its wrapper looks different")
    import gc
    # The wrappers are the functions whose code is `code` (its referrers: 16 ms here,
    # against 42 ms for a Python loop over every object the collector tracks).
    for f in gc.get_referrers(code):
        if type(f) is types.FunctionType and f.__code__ is code:
            fn = f.__closure__[i_fn].cell_contents
            if getattr(fn, "__dynamo_disable", None) is None:
                try:
                    fn.__dynamo_disable = _UntilDynamo(fn, f.__closure__[i_rec].cell_contents)
                except (AttributeError, TypeError):
                    pass  # a builtin or slotted callable takes no attribute: its wrapper stays PyTorch's
    return True



# ---- lazy_optimizer_dynamo --------------------------------------------------------------------
# torch.optim's `step` wrapper (`_use_grad_for_differentiable`) imports torch._dynamo at every
# call to put a graph break on either side of the step, a no-op unless Dynamo is tracing, which
# it cannot be before it is imported: a training script's first step paid the import. Until
# torch._dynamo starts loading, the wrappers run a stand-in without the import and the no-op
# breaks; an import hook gives them back PyTorch's code as the import begins, before anything
# can trace (so Dynamo only ever sees PyTorch's own wrapper).

def _grad_mode_step():
    func = None   # stands for the cell of PyTorch's wrapper, which keeps its own

    def _use_grad(*args, **kwargs):
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)
    return _use_grad


_STEP_STAND_IN = _grad_mode_step().__code__
_swapped_steps: list = []   # [(function, PyTorch's code)]


class _RestoreOptimizerSteps:
    """Gives the optimizers' step wrappers back PyTorch's code when torch._dynamo starts loading."""

    def find_spec(self, name, path, target=None):
        if name == "torch._dynamo":
            restore_optimizer_steps()
        return None


def restore_optimizer_steps() -> None:
    """Undoes `lazy_optimizer_dynamo` (the import of torch._dynamo calls it)."""
    # A new list, not a removal: the import system may be iterating over the old one (a
    # removal from it would skip the finder after this one, e.g. `quiet_gc_imports`' hook).
    if any(isinstance(f, _RestoreOptimizerSteps) for f in sys.meta_path):
        sys.meta_path = [f for f in sys.meta_path if not isinstance(f, _RestoreOptimizerSteps)]
    while _swapped_steps:
        fn, code = _swapped_steps.pop()
        fn.__code__ = code


def lazy_optimizer_dynamo() -> bool:
    """The stand-in above for the `step` of every optimizer class defined so far (torch.optim's
    and any subclass of `Optimizer`), and the hook that takes it back."""
    if "torch._dynamo" in sys.modules:
        return True
    from torch.optim import optimizer as opt_mod
    outer = getattr(opt_mod, "_use_grad_for_differentiable", None)
    inner = [c for c in getattr(getattr(outer, "__code__", None), "co_consts", ())
             if isinstance(c, types.CodeType) and c.co_name == "_use_grad"]
    if (len(inner) != 1 or inner[0].co_freevars != _STEP_STAND_IN.co_freevars
            or "graph_break" not in inner[0].co_names or opt_mod.__dict__.get("torch") is not torch):
        return patches.refuse("torch.optim's step wrapper", "it looks different")
    code, seen, classes = inner[0], set(), [opt_mod.Optimizer]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        fn = cls.__dict__.get("step")
        # A class stepped once is wrapped again by the optimizer's profiling hook.
        while fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            if type(fn) is types.FunctionType and fn.__code__ is code:
                fn.__code__ = _STEP_STAND_IN
                _swapped_steps.append((fn, code))
                break
            fn = getattr(fn, "__wrapped__", None)
    if _swapped_steps and not any(isinstance(f, _RestoreOptimizerSteps) for f in sys.meta_path):
        sys.meta_path.insert(0, _RestoreOptimizerSteps())
    return True
