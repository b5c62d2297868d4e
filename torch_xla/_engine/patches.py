"""Every change torch_xla makes to PyTorch, jax or the process, in one registry that installs them.

Each `Patch` owns its install function (named by path, `"module:function"` under
`torch_xla`), the phase that installs it, the variable that turns it off, what it changes
and why. One call per phase installs that phase's entries, in registry order:

- `install_phase(IMPORT)`: `import torch_xla` (`torch_xla/__init__.py`);
- `install_phase(JAX_START)`: the first use of a device, before jax is imported (`boot`);
- `install_phase(JOB_START)`: a process of a multi-process job, before it joins (`boot`);
- `install_phase(STARTED)`: once jax has started and the job is joined (`boot`).

Entries with no phase are installed by the feature that needs them, at its first use,
through `install(name)` (an exit hook when the first parallel loader starts, say). Nothing
else in the package changes PyTorch, jax or the process.

The registry sits below every layer it patches (it imports only `env_vars`): installers are
imported by name when their entry is installed, so any module can ask for an entry.
`docs/ARCHITECTURE.md`'s section "What importing torch_xla changes in your process" is
generated from `REGISTRY` (`python -m torch_xla._engine.patches`); a test keeps the two equal,
and a test per opt-out checks that the piece of PyTorch it names is left untouched.
"""
from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from . import env_vars

IMPORT = "import"
JAX_START = "jax start"
JOB_START = "job start"
STARTED = "started"
PHASES = (IMPORT, JAX_START, JOB_START, STARTED)


@dataclass(frozen=True)
class Patch:
    name: str
    target: str             # what is changed
    when: str               # when it is installed, in words (the docs' column)
    opt_out: Optional[str]  # the variable that turns it off; or words saying why there is none
    why: str
    installer: str          # "module:function" under torch_xla
    phase: Optional[str] = None   # one of PHASES; None: installed by its feature through install()
    probe: Optional[str] = None   # an expression showing the change (tests: equal with the opt-out)


REGISTRY: List[Patch] = [
    Patch("xla_device", "PyTorch's PrivateUse1 backend: renamed `xla`, with a device module "
          "(`torch.xla`), hooks and a device guard", "import", "none (the xla device itself)",
          "the `xla` device itself; affects xla tensors only",
          "_engine.device:register", IMPORT),
    Patch("xla_autocast_dtype", "`torch.set_autocast_dtype('xla', torch.bfloat16)` (thread-local state of the "
          "importing thread)", "import", "none (xla autocast only)",
          "PyTorch/XLA's default autocast dtype is bfloat16 (PrivateUse1's is float16); affects "
          "`torch.autocast('xla')` only", "_engine.device:set_autocast_dtype", IMPORT),
    Patch("xla_kernels", "`torch.library` kernels for the PrivateUse1 / AutogradPrivateUse1 / "
          "QuantizedPrivateUse1 / AutocastPrivateUse1 keys, a PrivateUse1 fallback and an "
          "AutocastPrivateUse1 fallthrough", "import", "none (the xla device's ops)",
          "the xla device's ops; affects xla tensors only", "_engine.kernels:register", IMPORT),
    Patch("functionalize_copy", "the Functionalize kernel of `aten::copy_`", "import",
          "PT_XLA_FUNCTIONALIZE_COPY",
          "`cpu.copy_(xla)` (`load_state_dict` into a CPU model, DDP's C++ parameter checks) "
          "reaches functionalization with a plain destination and a functional source, which "
          "PyTorch refuses for every device but DeviceType::XLA; the kernel reads the source "
          "first. A copy into a view with `as_strided` past the first view of its chain, which "
          "PyTorch refuses for the same reason, is written into the view's base. Otherwise it "
          "does what PyTorch's does",
          "_engine.kernels.functionalize:install_copy", IMPORT,
          "_functionalize_line('aten::copy_')"),
    Patch("functionalize_to_copy", "the Functionalize kernel of `aten::_to_copy`", "import",
          "PT_XLA_FUNCTIONALIZE_TO_COPY",
          "PyTorch's kernel leaves `x.to(dtype)` unwrapped for every device but XLA and Lazy; "
          "autograd's copy of such a tensor saved as an output (relu, tanh, exp) loses the "
          "lazy value and the backward fails. Ours wraps results on the xla device and "
          "otherwise does what PyTorch's does",
          "_engine.kernels.functionalize:install_to_copy", IMPORT,
          "_functionalize_line('aten::_to_copy')"),
    Patch("lean_inplace_meta", "the Meta kernels of ~15 in-place elementwise ops (`add_`, "
          "`mul_`, `addcmul_`, `lerp_`...)", "import", "PT_XLA_LEAN_INPLACE_META",
          "functionalization checks every in-place op by running PyTorch's Python meta kernel "
          "(tens of microseconds); inside that check only, a check that passed for the same "
          "shapes, dtypes and scalar types is not run again. Outside functionalization (a "
          "plain meta tensor) PyTorch's kernel runs unchanged",
          "_engine.kernels.meta:install", IMPORT, "_meta_line('aten::add_.Tensor')"),
    Patch("module_apply", "`torch.nn.Module._apply`", "import", "PT_XLA_PATCH_MODULE_APPLY",
          "`module.to(xla)` gives each module its own new Parameter (CPU and xla tensors "
          "cannot swap data in place): parameters that two modules shared (an embedding tied "
          "to an LM head) are shared again afterwards",
          "_engine.process_patches:install_module_apply", IMPORT, "torch.nn.Module._apply"),
    Patch("nn_gru", "`torch.nn.GRU` (the original stays as `torch.nn.GRU._orig`)", "import",
          "PT_XLA_PATCH_GRU",
          "a subclass (`torch_xla.experimental.gru.GRU`) that runs each layer's time loop on "
          "xla tensors as one program loop instead of one traced step per time step; other "
          "devices, packed sequences and bidirectional GRUs take PyTorch's own code",
          "experimental.gru:install", IMPORT, "torch.nn.GRU"),
    Patch("xla_while_loop", "PyTorch's `while_loop` higher-order op (`torch._higher_order_ops.while_loop`): a "
          "kernel for the PrivateUse1 key", "import", "none (affects xla tensors only)",
          "`while_loop` on xla tensors is one loop of the compiled program with its condition read on the "
          "device (`torch_xla.experimental.fori_loop`); PyTorch's own kernel would run a host loop, reading "
          "the condition back at every iteration",
          "experimental.fori_loop:install", IMPORT),
    Patch("clip_grad_norm", "`torch.nn.utils.clip_grad_norm_` (the original stays as its `_orig`)",
          "import", "PT_XLA_PATCH_CLIP_GRAD_NORM",
          "when none of the parameters has a gradient, PyTorch returns a zero on the CPU; for "
          "parameters on the xla device the zero is on their device, as the norm is when they "
          "have gradients (PyTorch/XLA returns it there). Otherwise PyTorch's own function runs",
          "_internal.clip_grad:install", IMPORT, "torch.nn.utils.clip_grad_norm_"),
    Patch("load_to_device", "`torch.load`'s deserializers (`torch.serialization.register_package`, priority 9): "
          "locations `xla` / `xla:N` are restored by torch_xla", "import", "PT_XLA_LOAD_TO_DEVICE",
          "`torch.load(f, map_location='xla')` of CPU tensors reached PyTorch's PrivateUse1 "
          "deserializer, which allocates a device storage with an allocator the xla device cannot "
          "have (Python cannot register one): a segmentation fault. Ours returns an xla storage "
          "carrying the CPU one, and `set_` from it (`_rebuild_tensor`) uploads the tensor "
          "(`kernels/storage.py`); other locations reach PyTorch's deserializers, saving is unchanged",
          "_engine.kernels.storage:install_load", IMPORT,
          "[fn for _, _, fn in torch.serialization._package_registry]"),
    Patch("xla_storage_refused", "`torch.UntypedStorage.__new__`: a RuntimeError for the xla device", "import",
          "none (xla storages only)",
          "xla tensors have no storage and PyTorch would allocate one with the missing PrivateUse1 "
          "allocator (a segmentation fault): `torch.UntypedStorage(n, device='xla')`, "
          "`TypedStorage(n, device='xla')`, `storage.to(device='xla')`, an xla storage's `clone()`; "
          "affects the xla device only", "_engine.kernels.storage:install_storage_check", IMPORT),
    Patch("dynamo_skips_engine", "TorchDynamo's trace rules: `torch_xla._engine`, `torch_xla._XLAC`, "
          "`torch_xla.distributed.spmd`, `jax`, `jaxlib`, `ml_dtypes` and the generated kernels (`<kernel ...>`) "
          "added to its skipped files", "import (applied when `torch._dynamo.trace_rules` loads: an import hook)",
          "none (torch.compile needs it)",
          "the xla device's kernels are Python: Dynamo must run them, and what they call, as "
          "it runs C++ kernels, instead of tracing into them (a call that reaches the engine "
          "in a compiled function is a graph break; `xm.all_reduce` of one tensor is an op; "
          "`mark_sharding` is an op of the graph: `mark_sharding_in_graph`)",
          "_engine.process_patches:install_dynamo_skips", IMPORT),
    Patch("mark_sharding_in_graph", "TorchDynamo: a stand-in for `torch_xla.distributed.spmd.mark_sharding` "
          "(`torch.compiler.substitute_in_graph`, registered when `torch._dynamo` loads: an import hook), and "
          "`xla::dynamo_mark_sharding` added to torch.fx's side-effectful functions",
          "import of torch_xla.distributed.spmd", "PT_XLA_MARK_SHARDING_IN_GRAPH",
          "`mark_sharding` on an activation inside a compiled function is an op of the graph "
          "(`xla::dynamo_mark_sharding`), laid out inside the program, instead of a graph break; the op's "
          "result is often unused (it annotates its input) and graph passes must keep it",
          "distributed._mark_sharding_in_graph:install",
          probe='"dynamo_mark_sharding" in str(torch.fx.node._side_effectful_functions)'),
    Patch("quiet_gc_imports", "Python's garbage collector: paused during `import torch_xla` (`torch_xla/__init__.py`) "
          "and during the import of `torch._dynamo` (an import hook); at the end of each, the youngest "
          "generation collected, `gc.freeze()`, the collector's state restored",
          "import", "PT_XLA_TUNE_GC",
          "the collector's full passes over torch's ~370k import-time objects made up a third "
          "of these imports (BENCHMARKS.md, \"Imports with the collector paused\")",
          "_engine.process_patches:install_quiet_dynamo_import", IMPORT,
          "_meta_path_hooks()"),
    Patch("lazy_dynamo_disable", "PyTorch's `torch._disable_dynamo` wrappers (found with "
          "`gc.get_referrers` of their code)", "import (last, before the collector's freeze would hide them)",
          "PT_XLA_LAZY_DYNAMO_DISABLE",
          "PyTorch's Python meta kernels import `torch._dynamo` (1-2 s) on their first call "
          "only to mark themselves untraceable; until something imports it they run plainly",
          "_engine.process_patches:lazy_dynamo_disable", IMPORT, "_dynamo_disable_stand_ins()"),
    Patch("lazy_optimizer_dynamo", "the `step` of torch.optim's optimizer classes (and of any `Optimizer` "
          "subclass defined before `import torch_xla`): the code of PyTorch's `_use_grad` wrapper, until "
          "`torch._dynamo` starts loading (an import hook puts PyTorch's code back)", "import",
          "PT_XLA_LAZY_OPTIMIZER_DYNAMO",
          "PyTorch's wrapper imports `torch._dynamo` (0.5-0.6 s) at the first step only to place graph "
          "breaks, which do nothing unless Dynamo is tracing; until something imports it the step sets "
          "the grad mode and runs as PyTorch's does",
          "_engine.process_patches:lazy_optimizer_dynamo", IMPORT,
          "torch.optim.SGD.step.__code__.co_filename"),
    Patch("lazy_symbolic_shapes", "`torch.fx.experimental.symbolic_shapes` (when not imported yet): a module "
          "object answering the helpers the eager meta kernels call (`expect_true`, `guard_or_false`, `sym_eq`...) "
          "for plain bools and ints, into which PyTorch's module is executed at the first other use; and "
          "`elementwise_dtypes` of `torch._prims_common` and `torch._meta_registrations`, until sympy starts "
          "loading (an import hook puts PyTorch's function back)", "import", "PT_XLA_LAZY_SYMBOLIC_SHAPES",
          "`torch._check` and PyTorch's Python meta kernels and references import symbolic_shapes, and "
          "with it sympy (0.3-0.5 s), at their first call, only to pass plain values through helpers that "
          "are identities for them: the first traced step paid the import. A symbolic value or any other "
          "name gets PyTorch's module (the same module object, so every reference sees it); dtype "
          "promotion of anything but tensors and Python numbers gets PyTorch's function",
          "_engine.process_patches:lazy_symbolic_shapes", IMPORT,
          "type(sys.modules.get('torch.fx.experimental.symbolic_shapes')).__name__ == '_LazySymbolicShapes'"),
    Patch("xla_flags", "the `XLA_FLAGS` and `JAX_PLATFORMS` environment variables",
          "first device use, before jax starts", "XLA_FLAGS naming the flag yourself",
          "`JAX_PLATFORMS` from `PJRT_DEVICE`; on CPU, XLA's memory-minimising scheduler "
          "(`--xla_cpu_enable_concurrency_optimized_scheduler=false`) and "
          "`CPU_NUM_DEVICES` virtual devices", "_engine.boot:configure_env", JAX_START),
    Patch("malloc_arena_limit", "glibc's allocator: one malloc arena for the threads started from then on "
          "(`mallopt(M_ARENA_MAX, 1)`; not with `PT_XLA_RETAIN_HOST_MEMORY=threads`)",
          "import, when `PJRT_DEVICE=CPU` (or `JAX_PLATFORMS=cpu`) is set then", "PT_XLA_RETAIN_HOST_MEMORY",
          "the first part of `retain_host_memory`, before any thread allocates: a thread that allocates "
          "earlier (PyTorch's OpenMP workers while a model is built) gets an arena of its own, glibc "
          "then hands XLA's threads the existing arenas in turn, and a large block from a non-main "
          "arena is mmapped and page-faulted in at every step (the decoder's step: 58,000 faults "
          "and ~30% slower in a quarter of the processes)", "_engine.boot:limit_malloc_arenas", IMPORT,
          "_arenas_unlimited()"),
    Patch("retain_host_memory", "glibc's allocator (`mallopt`: one arena, no mmap, no trim; with "
          "`PT_XLA_RETAIN_HOST_MEMORY=threads` an arena per thread with a 64 MiB top pad, and CPU "
          "programs compiled with their temporary buffer in pieces of at most 32 MiB)",
          "first device use on CPU, before jax's CPU client starts", "PT_XLA_RETAIN_HOST_MEMORY",
          "XLA:CPU's large buffers would be mmapped and page-faulted in again at every step "
          "(`platform/host_memory.py`)", "_engine.boot:retain_host_memory", JAX_START,
          "_large_block_is_mmapped()"),
    Patch("cpu_blas_target", "jax's registry of FFI targets: `torch_xla_cpu_matmul_f32` (platform `cpu`), "
          "the native handler given PyTorch's `sgemm` and MKL's per-thread thread count",
          "the first compile of a CPU program", "PT_XLA_CPU_BLAS",
          "the product handler (`platform/cpu_blas.py`): without AVX-512, XLA:CPU's batched and "
          "transposed float32 products are slower than PyTorch's BLAS; with it, its long, narrow "
          "reductions (a convolution's weight gradient)", "_engine.platform.cpu_blas:register", None,
          "_ffi_target_registered('torch_xla_cpu_matmul_f32')"),
    Patch("jax_x64", "jax's process-wide `jax_enable_x64` option, on", "first device use, when jax starts",
          "none (torch's int64 and float64 need it)",
          "PyTorch's default integer type is int64 and float64 tensors exist: with 32-bit jax "
          "they would silently narrow. Other jax code in the process also sees 64-bit defaults "
          "(`jnp.arange(3)` is int64)", "_engine.process_patches:enable_x64", JAX_START),
    Patch("cpu_collectives_gloo", "jax's `jax_cpu_collectives_implementation` option: `gloo`; "
          "the `cpu` backend factory of `jax._src.xla_bridge` (gloo's collectives made with a host name)",
          "a process of a multi-process CPU job, before it joins", "none (CPU collectives across processes need it)",
          "jax's CPU client runs no collective across processes without it; jax lets gloo listen on "
          "whatever the machine's host name resolves to: the factory passes 127.0.0.1 in a "
          "single-host job (a multi-host job keeps the host name's address, which the other hosts reach)",
          "_engine.job:use_gloo_collectives", JOB_START),
    Patch("tune_gc", "Python's garbage collector (`gc.freeze()`, youngest threshold 10,000)",
          "first device use, once jax has started", "PT_XLA_TUNE_GC",
          "traced ops keep Python objects alive until the barrier: the collector's passes "
          "rescanned them and the imports' ~370k objects (63% of tracing time at 20k pending "
          "ops, `bench/bench_gc.py`)", "_engine.process_patches:tune_gc", STARTED,
          "gc.get_threshold()[0]"),
    Patch("inline_backward", "the autograd engine's `run_backward` "
          "(`torch.autograd.Variable._execution_engine`): multithreading off during each call",
          "first xla device use of a process of a multi-process CPU job",
          "none (a backward on `xla:1` and above needs it)",
          "there a process's device is `xla:<global ordinal>`; PyTorch's autograd engine keeps "
          "one worker queue per device index that the device guard reports, and a Python "
          "device guard reports one, so a gradient on `xla:1` would fail its internal assert. "
          "With multithreading off the engine runs the backward in the calling thread, as it "
          "does for CPU tensors. Every replica of the job, `xla:0` too, runs it that way",
          "_engine.process_patches:install_inline_backward"),
    Patch("metrics_ready_thread", "a daemon thread `xla-metrics-ready` and an exit hook (`atexit`) that stops it",
          "the first execution whose time is measured when its result is ready",
          "none (the execution metrics need it)",
          "`ExecuteTime` is the time until a program's outputs are ready: one thread waits for them "
          "instead of the caller; the exit hook stops it before jax's own (a thread inside "
          "`block_until_ready` while the interpreter finalizes would abort the process)",
          "_engine.telemetry:start_waiter"),
    Patch("tiered_compile_thread", "a daemon thread `torch_xla-tiered-compile` and an exit hook that stops it",
          "the first tiered compile", "`XLA_TIERED_COMPILE` unset (the default)",
          "the optimized executables of tiered compilation compile in the background; at exit the "
          "queued compiles are dropped", "_engine.executor.tiers:start_worker"),
    Patch("debug_exit_summary", "an exit hook (`atexit`) printing the debug summary", "import, when "
          "`PT_XLA_DEBUG_LEVEL` (or `PT_XLA_DEBUG`) is set", "`PT_XLA_DEBUG_LEVEL` unset (the default)",
          "the summary of compiles and host transfers the debug level promises at exit",
          "_engine.executor.analysis:register_summary"),
    Patch("device_checks_at_exit", "an exit hook (`atexit`) reading the device-side checks of the programs "
          "never inspected, kept the last registered", "the first run of a program with device-side checks "
          "(index ranges, integer divisors)", "`XLA_CHECK_INDICES=0` (no checks, no hook)",
          "an out-of-range index or an integer division by zero in the last step before exit is reported "
          "(the CPU's error, on stderr) and the process exits with status 1, after running the other "
          "exit handlers; it runs before jax's own, which tear the runtime down",
          "_engine.executor.checks:install_exit_hook"),
    Patch("close_loaders_at_exit", "an exit hook (`atexit`) closing the parallel loaders still running",
          "the first `ParallelLoader` / `MpDeviceLoader` made", "none (loader threads would block the exit)",
          "a loader's worker threads wait on its queues; at exit they are closed and joined so the "
          "interpreter does not hang on them", "distributed.parallel_loader:register_exit_hook"),
    Patch("xla_process_group", "`torch.distributed`: backend `xla` (its creator in PyTorch's extended "
          "form, which receives a subgroup's global ranks and `new_group`'s `pg_options`) and the "
          "`xla://` rendezvous", "import of torch_xla.distributed.xla_backend", "none (affects the `xla` backend only)",
          "the documented `init_process_group('xla', init_method='xla://')` and `new_group` "
          "over xla replicas", "distributed.xla_backend:install"),
]
_BY_NAME: Dict[str, Patch] = {p.name: p for p in REGISTRY}
_installed: Dict[str, bool] = {}   # name -> installed (False: turned off or refused)
_lock = threading.RLock()          # installers may ask for other entries


def enabled(name: str) -> bool:
    """Whether the entry is on (its opt-out variable is not set to 0)."""
    p = _BY_NAME[name]
    if p.opt_out is None or p.opt_out not in env_vars.VARS:
        return True
    value = env_vars.get(p.opt_out)
    if isinstance(value, str):   # a setting with values of its own: `0` and its synonyms are off
        word = value.strip().lower()
        return not word or word not in env_vars.FALSE_WORDS
    return bool(value)


def install(name: str) -> bool:
    """Installs entry `name` once (nothing when it is turned off); whether it is installed."""
    done = _installed.get(name)
    if done is not None:
        return done
    with _lock:
        if name in _installed:
            return _installed[name]
        p = _BY_NAME[name]
        on = enabled(name)
        if on:
            module, _, fn = p.installer.partition(":")
            result = getattr(importlib.import_module("torch_xla." + module), fn)()
            on = result is not False   # an installer refusing a PyTorch that looks different says False
        _installed[name] = on
        return on


def install_phase(phase: str) -> None:
    """Installs every entry of `phase`, in registry order."""
    assert phase in PHASES, phase
    for p in REGISTRY:
        if p.phase == phase:
            install(p.name)


def installed(name: str) -> bool:
    return bool(_installed.get(name))


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


def refuse(name: str, why: str) -> bool:
    """For installers: warns that `name` is left alone because `why`; returns False."""
    warnings.warn(f"torch_xla: not patching {name}: {why}")
    return False


# ---- the documentation ------------------------------------------------------------------------

def markdown() -> str:
    """The ARCHITECTURE.md section generated from REGISTRY."""
    lines = ["| what | changed | when | turn it off | why |", "| --- | --- | --- | --- | --- |"]
    for p in REGISTRY:
        off = f"`{p.opt_out}=0`" if p.opt_out in env_vars.VARS else p.opt_out
        lines.append(f"| `{p.name}` | {p.target} | {p.when} | {off} | {p.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
