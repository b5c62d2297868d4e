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


class _UndoOnImport:
    """A meta-path finder that calls `undo` when module `module` starts loading (it finds
    nothing itself): how a stand-in gives PyTorch's code back at the first real use."""

    def __init__(self, module: str, undo):
        self.module = module
        self.undo = undo

    def find_spec(self, name, path, target=None):
        if name == self.module:
            self.undo()
        return None


def _hooked(undo) -> bool:
    return any(isinstance(f, _UndoOnImport) and f.undo is undo for f in sys.meta_path)


def _hook_import(module: str, undo) -> None:
    if not _hooked(undo):
        sys.meta_path.insert(0, _UndoOnImport(module, undo))


def _unhook_import(undo) -> None:
    # A new list, not a removal: the import system may be iterating over the old one (a
    # removal from it would skip the finder after this one, e.g. `quiet_gc_imports`' hook).
    if _hooked(undo):
        sys.meta_path = [f for f in sys.meta_path if not (isinstance(f, _UndoOnImport) and f.undo is undo)]


def restore_optimizer_steps() -> None:
    """Undoes `lazy_optimizer_dynamo` (the import of torch._dynamo calls it)."""
    _unhook_import(restore_optimizer_steps)
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
    if _swapped_steps:
        _hook_import("torch._dynamo", restore_optimizer_steps)
    return True


# ---- lazy_symbolic_shapes ---------------------------------------------------------------------
# PyTorch's Python meta kernels and references call a dozen helpers of
# torch.fx.experimental.symbolic_shapes (`torch._check`'s `expect_true`, `guard_or_false`,
# `sym_eq`...) through function-level imports, and `elementwise_dtypes` imports sympy at each call:
# the first traced step imported both (sympy's 400 modules). For the plain bools, ints and tensors
# of eager meta kernels those helpers are identities or constants. Until something needs more,
# the module is a stand-in answering those calls and handing anything else (a SymInt, another
# name) to PyTorch's module, which is then executed into the same module object, so that every
# reference to it sees PyTorch's module; `elementwise_dtypes` gets a stand-in computing the
# same dtypes without sympy until sympy starts loading (an import hook puts it back).

_SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
_load_lock = threading.RLock()
_loading = threading.local()


class _LazySymbolicShapes(types.ModuleType):
    """`torch.fx.experimental.symbolic_shapes` before its first use that needs PyTorch's code."""

    def __getattr__(self, name):
        # The import system asks a module for `__path__` (packages have one; PyTorch's module not).
        if name == "__path__" or getattr(_loading, "active", False):
            raise AttributeError(f"partially initialized module {_SYMBOLIC_SHAPES!r} has no attribute {name!r}")
        return getattr(load_symbolic_shapes(), name)

    def __setattr__(self, name, value):
        if getattr(_loading, "active", False):
            self.__dict__[name] = value
        else:
            setattr(load_symbolic_shapes(), name, value)

    def __delattr__(self, name):
        if getattr(_loading, "active", False):
            del self.__dict__[name]
        else:
            delattr(load_symbolic_shapes(), name)

    def __dir__(self):
        return dir(load_symbolic_shapes())


def load_symbolic_shapes() -> types.ModuleType:
    """PyTorch's symbolic_shapes, executed into the stand-in the first time (or imported)."""
    mod = sys.modules.get(_SYMBOLIC_SHAPES)
    if type(mod) is not _LazySymbolicShapes:
        if mod is None:
            import importlib
            mod = importlib.import_module(_SYMBOLIC_SHAPES)
        return mod
    with _load_lock:
        if type(mod) is _LazySymbolicShapes and not getattr(_loading, "active", False):
            for name in _STAND_INS:
                mod.__dict__.pop(name, None)
            _loading.active = True
            try:
                mod.__spec__.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(_SYMBOLIC_SHAPES, None)
                raise
            finally:
                _loading.active = False
            object.__setattr__(mod, "__class__", types.ModuleType)
            _rebind({id(f): mod.__dict__[name] for name, f in _STAND_INS.items() if name in mod.__dict__})
    return mod


def _rebind(replacements: dict) -> None:
    """Module globals that still hold a stand-in (a module that imported one by name while it
    stood in) get PyTorch's object instead."""
    me = sys.modules.get(__name__)
    for m in list(sys.modules.values()):
        d = getattr(m, "__dict__", None)
        if m is me or type(d) is not dict:
            continue
        for k, v in list(d.items()):
            if id(v) in replacements and callable(v):
                d[k] = replacements[id(v)]


def _pytorch(name: str):
    return getattr(load_symbolic_shapes(), name)


def _plain_ints(x) -> bool:
    if type(x) in (int, bool):
        return True
    return isinstance(x, (list, tuple)) and all(_plain_ints(v) for v in x)   # torch.Size too


def _expect_true(a, skip=0):
    if type(a) is bool:
        return a
    return _pytorch("expect_true")(a, skip + 1)


def _guard_or_false(a):
    return a if type(a) is bool else _pytorch("guard_or_false")(a)


def _guard_or_true(a):
    return a if type(a) is bool else _pytorch("guard_or_true")(a)


def _guard_size_oblivious(expr):
    # Imported by `is_contiguous` but seldom called; PyTorch's warns that it is deprecated.
    return _pytorch("guard_size_oblivious")(expr)


def _statically_known_true(x):
    return x if type(x) is bool else _pytorch("statically_known_true")(x)


def _guarding_hint_or_throw(a):
    return a if type(a) in (int, bool) else _pytorch("guarding_hint_or_throw")(a)


def _has_guarding_hint(a):
    return True if not isinstance(a, _SYM_TYPES) else _pytorch("has_guarding_hint")(a)


def _is_nested_int(s):
    return False if not isinstance(s, torch.SymInt) else _pytorch("is_nested_int")(s)


def _sym_and(x, *others):
    if type(x) is bool and all(type(y) is bool for y in others):
        return x and all(others)
    return _pytorch("sym_and")(x, *others)


def _sym_or(x, *others):
    if type(x) is bool and all(type(y) is bool for y in others):
        return x or any(others)
    return _pytorch("sym_or")(x, *others)


def _sym_eq(x, y):
    if _plain_ints(x) and _plain_ints(y):
        return _plain_eq(x, y)
    return _pytorch("sym_eq")(x, y)


def _plain_eq(x, y) -> bool:
    seq_x, seq_y = isinstance(x, (list, tuple)), isinstance(y, (list, tuple))
    if seq_x and seq_y:
        return len(x) == len(y) and all(_plain_eq(a, b) for a, b in zip(x, y))
    if seq_x or seq_y:
        return _pytorch("sym_eq")(x, y)   # PyTorch's error
    return x == y


def _free_unbacked_symbols(x):
    if type(x) is torch.Tensor and x.layout is torch.strided and all(type(n) is int for n in x.shape):
        from torch.utils._ordered_set import OrderedSet
        return OrderedSet()
    return _pytorch("free_unbacked_symbols")(x)


_STAND_INS = {f.__name__[1:]: f for f in (
    _expect_true, _guard_or_false, _guard_or_true, _guard_size_oblivious, _statically_known_true,
    _guarding_hint_or_throw, _has_guarding_hint, _is_nested_int, _sym_and, _sym_or, _sym_eq,
    _free_unbacked_symbols)}


def _elementwise_dtypes(*_args, type_promotion_kind):
    """PyTorch's `elementwise_dtypes` for tensors and Python numbers, without importing sympy:
    the highest category (bool < int < float < complex) among all arguments, its dtype
    from the tensors of at least one dimension, else the 0-d ones, else the default;
    then the promotion kind's rule. Any other argument goes to PyTorch's function."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as kinds, get_computation_dtype
    result = _result_dtype(_args)
    if result is None or not isinstance(type_promotion_kind, kinds):
        return _pytorch_elementwise_dtypes(*_args, type_promotion_kind=type_promotion_kind)
    compute = get_computation_dtype(result)
    if type_promotion_kind is kinds.NO_OPMATH:
        return result, result
    if type_promotion_kind is kinds.INT_TO_FLOAT:
        if _CATEGORY.get(result, 9) <= 1:
            result = torch.get_default_dtype()
        return get_computation_dtype(result), result
    if type_promotion_kind is kinds.COMPLEX_TO_FLOAT:
        return compute, _REAL_OF.get(result, result)
    if type_promotion_kind is kinds.BOOL_TO_LONG:
        return (torch.long, torch.long) if result is torch.bool else (compute, result)
    if type_promotion_kind is kinds.ALWAYS_BOOL:
        return compute, torch.bool
    return compute, result   # DEFAULT


# The dtypes PyTorch's promotion orders, by category: bool 0, integers 1, floats 2, complex 3.
_CATEGORY = {torch.bool: 0, torch.uint8: 1, torch.int8: 1, torch.int16: 1, torch.int32: 1, torch.int64: 1,
             torch.float16: 2, torch.bfloat16: 2, torch.float32: 2, torch.float64: 2,
             torch.complex32: 3, torch.complex64: 3, torch.complex128: 3}
_SCALAR_CATEGORY = {bool: 0, int: 1, float: 2, complex: 3}
_COMPLEX_OF = {torch.float16: torch.complex32, torch.bfloat16: torch.complex64, torch.float32: torch.complex64,
               torch.float64: torch.complex128}
_REAL_OF = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _result_dtype(args):
    """The promoted result dtype, or None when an argument is not a tensor of an ordered dtype
    or a Python number."""
    highest, dims, zeros = 0, [], []
    for x in args:
        if x is None:
            continue
        if isinstance(x, torch.Tensor):
            c = _CATEGORY.get(x.dtype)
            if c is None:
                return None
            (dims if x.dim() else zeros).append(x.dtype)
        else:
            c = _SCALAR_CATEGORY.get(type(x))
            if c is None:
                return None
        if c > highest:
            highest = c
    if highest == 0:
        return torch.bool
    got = _highest_of(dims, highest) or _highest_of(zeros, highest)
    if got is not None:
        return got
    if highest == 1:
        return torch.long
    default = torch.get_default_dtype()
    return default if highest == 2 else _COMPLEX_OF[default]


def _highest_of(dtypes, category: int):
    out = None
    for d in dtypes:
        c = _CATEGORY[d]
        if c == category:
            pass
        elif category == 3 and c == 2:
            d = _COMPLEX_OF[d]
        else:
            continue
        out = d if out is None else torch.promote_types(out, d)
    return out


_pytorch_elementwise_dtypes = None
# Modules whose global `elementwise_dtypes` the eager meta kernels call.
_DTYPE_USERS = ("torch._prims_common", "torch._meta_registrations")


def restore_elementwise_dtypes() -> None:
    """Undoes the `elementwise_dtypes` half of `lazy_symbolic_shapes` (sympy's import calls it)."""
    _unhook_import(restore_elementwise_dtypes)
    if _pytorch_elementwise_dtypes is not None:
        _rebind({id(_elementwise_dtypes): _pytorch_elementwise_dtypes})


def lazy_symbolic_shapes() -> bool:
    """The stand-ins above: the module (when not imported yet) and `elementwise_dtypes` (when
    sympy is not imported yet)."""
    global _pytorch_elementwise_dtypes
    import importlib
    import importlib.util
    from torch import _prims_common
    lazy_module = _SYMBOLIC_SHAPES not in sys.modules
    lazy_dtypes = "sympy" not in sys.modules
    spec = importlib.util.find_spec(_SYMBOLIC_SHAPES) if lazy_module else None
    if lazy_module and (spec is None or not hasattr(spec.loader, "exec_module")):
        return patches.refuse(_SYMBOLIC_SHAPES, "it cannot be found as a source module")
    fn = _prims_common.__dict__.get("elementwise_dtypes")
    if lazy_dtypes and (getattr(fn, "__code__", None) is None or "sympy" not in fn.__code__.co_names):
        return patches.refuse("torch._prims_common.elementwise_dtypes", "it looks different")
    if lazy_module:
        mod = importlib.util.module_from_spec(spec)
        mod.__dict__.update(_STAND_INS)
        object.__setattr__(mod, "__class__", _LazySymbolicShapes)
        sys.modules[_SYMBOLIC_SHAPES] = mod
        setattr(importlib.import_module("torch.fx.experimental"), "symbolic_shapes", mod)
    if lazy_dtypes:
        _pytorch_elementwise_dtypes = fn
        for name in _DTYPE_USERS:
            mod = sys.modules.get(name)
            if mod is not None and mod.__dict__.get("elementwise_dtypes") is fn:
                mod.elementwise_dtypes = _elementwise_dtypes
        _hook_import("sympy", restore_elementwise_dtypes)
    return True
