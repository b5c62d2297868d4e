"""Everything importing torch_xla changes in PyTorch or in the process, in one registry.

Each entry says what it changes, why, when it is applied, how to turn it off, and checks
the signature of what it patches before patching (a PyTorch whose function looks
different is left alone, with a warning). `docs/ARCHITECTURE.md`'s section "What
importing torch_xla changes in your process" is generated from `REGISTRY`
(`python -m torch_xla._engine.patches`); a test keeps the two equal.

Entries whose work is a `torch.library` registration (kernels for the xla key, the
Functionalize kernel of `copy_`, the in-place meta checks) are installed by
`kernels.register()`, which asks `enabled()` here; the others are installed below.
"""
from __future__ import annotations

import inspect
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from . import collector, config


@dataclass(frozen=True)
class Patch:
    name: str
    target: str        # what is changed
    when: str          # "import" | "jax start" | "jax start on CPU" | "import of ..."
    opt_out: Optional[str]  # the environment variable that turns it off (None: xla device only)
    why: str


REGISTRY: List[Patch] = [
    Patch("xla_device", "PyTorch's PrivateUse1 backend: renamed `xla`, with a device module "
          "(`torch.xla`), hooks and a device guard", "import", None,
          "the `xla` device itself; affects xla tensors only"),
    Patch("xla_kernels", "`torch.library` kernels for the PrivateUse1 / AutogradPrivateUse1 / "
          "QuantizedPrivateUse1 / AutocastPrivateUse1 keys, a PrivateUse1 fallback and an "
          "AutocastPrivateUse1 fallthrough", "import", None,
          "the xla device's ops; affects xla tensors only"),
    Patch("functionalize_copy", "the Functionalize kernel of `aten::copy_`", "import",
          "PT_XLA_FUNCTIONALIZE_COPY",
          "`cpu.copy_(xla)` (`load_state_dict` into a CPU model, DDP's C++ parameter checks) "
          "reaches functionalization with a plain destination and a functional source, which "
          "PyTorch refuses for every device but DeviceType::XLA; the kernel reads the source "
          "first and otherwise does what PyTorch's does"),
    Patch("functionalize_to_copy", "the Functionalize kernel of `aten::_to_copy`", "import",
          "PT_XLA_FUNCTIONALIZE_TO_COPY",
          "PyTorch's kernel leaves `x.to(dtype)` unwrapped for every device but XLA and Lazy; "
          "autograd's copy of such a tensor saved as an output (relu, tanh, exp) loses the "
          "lazy value and the backward fails. Ours wraps results on the xla device and "
          "otherwise does what PyTorch's does"),
    Patch("lean_inplace_meta", "the Meta kernels of ~15 in-place elementwise ops (`add_`, "
          "`mul_`, `addcmul_`, `lerp_`...)", "import", "PT_XLA_LEAN_INPLACE_META",
          "functionalization checks every in-place op by running PyTorch's Python meta kernel "
          "(tens of microseconds); inside that check only, a check that passed for the same "
          "shapes, dtypes and scalar types is not run again. Outside functionalization (a "
          "plain meta tensor) PyTorch's kernel runs unchanged"),
    Patch("module_apply", "`torch.nn.Module._apply`", "import", "PT_XLA_PATCH_MODULE_APPLY",
          "`module.to(xla)` gives each module its own new Parameter (CPU and xla tensors "
          "cannot swap data in place): parameters that two modules shared (an embedding tied "
          "to an LM head) are shared again afterwards"),
    Patch("nn_gru", "`torch.nn.GRU` (the original stays as `torch.nn.GRU._orig`)", "import",
          "PT_XLA_PATCH_GRU",
          "a subclass (`torch_xla.experimental.gru.GRU`) that runs each layer's time loop on "
          "xla tensors as one program loop instead of one traced step per time step; other "
          "devices, packed sequences and bidirectional GRUs take PyTorch's own code"),
    Patch("clip_grad_norm", "`torch.nn.utils.clip_grad_norm_` (the original stays as its `_orig`)",
          "import", "PT_XLA_PATCH_CLIP_GRAD_NORM",
          "when none of the parameters has a gradient, PyTorch returns a zero on the CPU; for "
          "parameters on the xla device the zero is on their device, as the norm is when they "
          "have gradients (PyTorch/XLA returns it there). Otherwise PyTorch's own function runs"),
    Patch("load_to_device", "`torch.load`'s deserializers (`torch.serialization.register_package`, priority 9): "
          "locations `xla` / `xla:N` are restored by torch_xla", "import", "PT_XLA_LOAD_TO_DEVICE",
          "`torch.load(f, map_location='xla')` of CPU tensors reached PyTorch's PrivateUse1 "
          "deserializer, which allocates a device storage with an allocator the xla device cannot "
          "have (Python cannot register one): a segmentation fault. Ours returns an xla storage "
          "carrying the CPU one, and `set_` from it (`_rebuild_tensor`) uploads the tensor "
          "(`kernels/storage.py`); other locations reach PyTorch's deserializers, saving is unchanged"),
    Patch("xla_storage_refused", "`torch.UntypedStorage.__new__`: a RuntimeError for the xla device", "import",
          None,
          "xla tensors have no storage and PyTorch would allocate one with the missing PrivateUse1 "
          "allocator (a segmentation fault): `torch.UntypedStorage(n, device='xla')`, "
          "`TypedStorage(n, device='xla')`, `storage.to(device='xla')`, an xla storage's `clone()`; "
          "affects the xla device only"),
    Patch("xla_flags", "the `XLA_FLAGS` and `JAX_PLATFORMS` environment variables",
          "jax start", "XLA_FLAGS naming the flag yourself",
          "`JAX_PLATFORMS` from `PJRT_DEVICE`; on CPU, XLA's memory-minimising scheduler "
          "(`--xla_cpu_enable_concurrency_optimized_scheduler=false`) and "
          "`CPU_NUM_DEVICES` virtual devices"),
    Patch("retain_host_memory", "glibc's allocator (`mallopt`: one arena, no mmap, no trim)",
          "jax start on CPU", "PT_XLA_RETAIN_HOST_MEMORY",
          "XLA:CPU's large buffers would be mmapped and page-faulted in again at every step "
          "(`platform/host_memory.py`)"),
    Patch("lazy_dynamo_disable", "PyTorch's `torch._disable_dynamo` wrappers (found with "
          "`gc.get_referrers` of their code)", "import", "PT_XLA_LAZY_DYNAMO_DISABLE",
          "PyTorch's Python meta kernels import `torch._dynamo` (1-2 s) on their first call "
          "only to mark themselves untraceable; until something imports it they run plainly"),
    Patch("tune_gc", "Python's garbage collector (`gc.freeze()`, youngest threshold 10,000)",
          "jax start", "PT_XLA_TUNE_GC",
          "traced ops keep Python objects alive until the barrier: the collector's passes "
          "rescanned them and the imports' ~370k objects (63% of tracing time at 20k pending "
          "ops, `bench/bench_gc.py`)"),
    Patch("quiet_gc_imports", "Python's garbage collector: paused during `import torch_xla` and during "
          "the import of `torch._dynamo` (an import hook); at the end of each, the youngest "
          "generation collected, `gc.freeze()`, the collector's state restored",
          "import", "PT_XLA_TUNE_GC",
          "the collector's full passes over torch's ~370k import-time objects made up a third "
          "of these imports (`import torch_xla` after torch 0.59-0.67 -> 0.42-0.47 s, "
          "`torch._dynamo`, which torch.optim imports at its first step, 0.89-1.01 -> "
          "0.59-0.62 s, and no full pass of 0.18 s due right after)"),
    Patch("inline_backward", "the autograd engine's `run_backward` "
          "(`torch.autograd.Variable._execution_engine`): multithreading off during each call",
          "first xla device use of a process of a multi-process CPU job",
          "none (a backward on `xla:1` and above needs it)",
          "there a process's device is `xla:<global ordinal>`; PyTorch's autograd engine keeps "
          "one worker queue per device index that the device guard reports, and a Python "
          "device guard reports one, so a gradient on `xla:1` would fail its internal assert. "
          "With multithreading off the engine runs the backward in the calling thread, as it "
          "does for CPU tensors. Every replica of the job, `xla:0` too, runs it that way"),
    Patch("xla_process_group", "`torch.distributed`: backend `xla` and the `xla://` rendezvous",
          "import of torch_xla.distributed.xla_backend", None,
          "the documented `init_process_group('xla', init_method='xla://')`"),
    Patch("dynamo_skips_engine", "TorchDynamo's trace rules: `torch_xla._engine`, `torch_xla._XLAC`, "
          "`torch_xla.distributed.spmd`, `jax`, `jaxlib`, `ml_dtypes` and the generated kernels (`<kernel ...>`) "
          "added to its skipped files",
          "import of torch._dynamo",
          "none (torch.compile needs it)",
          "the xla device's kernels are Python: Dynamo must run them, and what they call, as "
          "it runs C++ kernels, instead of tracing into them (a call that reaches the engine "
          "in a compiled function is a graph break; `xm.all_reduce` of one tensor is an op; "
          "`mark_sharding` runs between the graphs it splits)"),
]
_BY_NAME = {p.name: p for p in REGISTRY}


def enabled(name: str) -> bool:
    """Whether the entry is on (its opt-out variable is not set to 0)."""
    p = _BY_NAME[name]
    if p.opt_out is None or p.opt_out not in config.VARS:
        return True
    return bool(config.get(p.opt_out))


def signature_matches(fn: Callable, params: List[str], name: str) -> bool:
    """Whether `fn` takes `params`; warns (and the caller leaves it alone) otherwise."""
    try:
        got = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        got = None
    if got != params:
        warnings.warn(f"torch_xla: not patching {name}: its signature is {got}, expected {params}")
        return False
    return True


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


def install_import_time() -> None:
    """The entries applied by `import torch_xla` that are not kernel registrations."""
    if (enabled("module_apply") and torch.nn.Module._apply is _orig_apply
            and signature_matches(_orig_apply, ["self", "fn", "recurse"], "torch.nn.Module._apply")):
        torch.nn.Module._apply = _apply
    install_dynamo_skips()
    if enabled("quiet_gc_imports"):
        install_quiet_dynamo_import()


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
# (`import torch_xla` pauses the collector itself: torch_xla/__init__.py.)

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


def after_jax_start() -> None:
    """The entries applied once jax has started (they must see its loaded modules)."""
    if enabled("tune_gc"):
        tune_gc()


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


def install_inline_backward() -> None:
    """`inline_backward` (idempotent)."""
    from torch.autograd.variable import Variable
    engine = Variable._execution_engine
    if isinstance(engine, _InlineBackwardEngine):
        return
    if not (hasattr(engine, "run_backward") and hasattr(torch._C, "_set_multithreading_enabled")):
        warnings.warn("torch_xla: not patching the autograd engine: it looks different; a backward "
                      "on a device other than xla:0 may fail")
        return
    Variable._execution_engine = _InlineBackwardEngine(engine)


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


_dynamo_patched = [False]


def lazy_dynamo_disable() -> None:
    """Gives every `torch._disable_dynamo` wrapper the stand-in above (once; nothing to do
    when torch._dynamo is already imported). It finds them among the collector's objects,
    before `gc.freeze()` would hide them."""
    if _dynamo_patched[0] or not enabled("lazy_dynamo_disable"):
        return
    _dynamo_patched[0] = True
    if "torch._dynamo" in sys.modules:
        return
    try:
        code = torch._compile._disable_dynamo(lambda: None).__code__
        i_fn, i_rec = code.co_freevars.index("fn"), code.co_freevars.index("recursive")
    except (AttributeError, ValueError):  # another torch: leave it alone
        warnings.warn("torch_xla: not patching torch._disable_dynamo: its wrapper looks different")
        return
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
                    pass


# ---- the documentation ------------------------------------------------------------------------

def markdown() -> str:
    """The ARCHITECTURE.md section generated from REGISTRY."""
    lines = ["| what | changed | when | turn it off | why |", "| --- | --- | --- | --- | --- |"]
    for p in REGISTRY:
        off = f"`{p.opt_out}=0`" if p.opt_out in config.VARS else (p.opt_out or "xla device only")
        lines.append(f"| `{p.name}` | {p.target} | {p.when} | {off} | {p.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
