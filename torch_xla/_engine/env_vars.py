"""Every environment variable torch_xla reads, in one place.

Each variable is declared once below with its type, default and meaning; the README's
table is this registry. Settings of the process (platform, dtypes, tuning opt-outs) are
parsed on first use and kept (`reload()` forgets them, for tests that change them at run
time). A process's place in a job (ranks, world size, coordinator) is read at every call:
launchers and tests set it after import. No other module of the package reads
`os.environ`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional


@dataclass(frozen=True)
class Var:
    name: str
    kind: str          # "str" | "int" | "float" | "bool"
    default: Any
    meaning: str
    cached: bool = True
    refused: str = ""  # why setting it has no effect here (warned at import when set)


_VARS = [
    Var("PJRT_DEVICE", "str", "", "`CPU`, `CUDA` or `TPU` (unset: the best available)"),
    Var("PJRT_SELECT_DEFAULT_DEVICE", "bool", True,
        "`0`: with `PJRT_DEVICE` unset, `xr.device_type()` is None instead of the best available",
        cached=False),
    Var("CPU_NUM_DEVICES", "int", 0,
        "CPU devices: in one process, that many virtual devices; for `torch_xla.launch` / "
        "`xmp.spawn`, that many processes", cached=False),
    Var("XLA_USE_BF16", "bool", False, "compute float32 and float64 in bfloat16 on the device (read at the first such tensor)"),
    Var("XLA_DOWNCAST_BF16", "bool", False,
        "compute float32 in bfloat16 and float64 in float32 on the device (read at the first such tensor)"),
    Var("XLA_USE_32BIT_LONG", "bool", False,
        "hold int64 and uint64 in 32 bits on the device (read at the first such tensor)"),
    Var("XLA_NO_SPECIAL_SCALARS", "bool", False,
        "make 0 and 1 graph parameters like every other Python scalar"),
    Var("XLA_NO_DONATION", "bool", False, "never donate the buffers of overwritten tensors"),
    Var("XLA_HLO_DEBUG", "bool", False,
        "record each traced op's Python source line: locations in the StableHLO / HLO text "
        "(`xm.get_stablehlo`, `XLA_SAVE_TENSORS_FMT=hlo`), `op_name` metadata in compiled programs"),
    Var("XLA_USE_SPMD", "bool", False,
        "SPMD mode (`xr.use_spmd()`): one program over every device, partitioned by XLA from "
        "`mark_sharding` annotations; in a job of one process per host, each host's process gets "
        "`CPU_NUM_DEVICES` CPU devices", cached=False),
    Var("XLA_AUTO_SPMD", "bool", False,
        "automatic sharding (`xr.use_spmd(auto=True)` sets it; implies SPMD mode): the inputs of "
        "each program are laid out over the mesh by a rule on their shapes, XLA propagates the rest "
        "(docs/auto_sharding.md)", cached=False),
    Var("XLA_AUTO_SPMD_MESH", "str", "",
        "the mesh of automatic sharding, sizes separated by commas (`2,2`); unset: every device in "
        "one axis (`<devices>,1`)", cached=False),
    Var("XLA_FLAGS", "str", "", "XLA's own flags, passed to the compiler", cached=False),
    Var("XLA_COLLECTIVE_TIMEOUT_S", "int", 1800,
        "seconds a process waits for its peers (job start, collectives, shutdown)"),
    Var("XLA_ALWAYS_ALLREDUCE", "bool", False,
        "`1`: with one replica, collectives (all-reduce, all-gather, reduce-scatter) stay in the "
        "program as XLA collectives over that replica instead of being left out (the HLO text "
        "shows them)", cached=False),
    Var("XLA_CHECK_INDICES", "bool", True,
        "`0`: no device-side checks of gather / scatter / index / embedding / loss-target indices "
        "and integer divisors (an out-of-range index then reads a clamped value, an integer division "
        "by zero returns a value, instead of raising)"),
    Var("XLA_CPU_OPERAND", "str", "move",
        "a CPU tensor (not 0-d) given to an op on xla tensors: `move` copies it to the device at each "
        "call, as PyTorch/XLA does, warning once per line of code; `error`: PyTorch's same-device "
        "RuntimeError", cached=False),
    Var("XLA_HEARTBEAT_TIMEOUT_S", "int", 60,
        "seconds without a heartbeat before the coordination service declares a process dead"),
    Var("XLA_EXPERIMENTAL", "str", "",
        "ops kept on the device with bounded dynamic shapes, `:`-separated: `nonzero`, `masked_select`, "
        "`masked_scatter`, `nms` (read at import; docs/dynamic_shapes.md)"),
    Var("XLA_TIERED_COMPILE", "bool", False,
        "`1`: a large program's first two runs use a quickly compiled executable (on CPU: "
        "XLA's fusion emitters off, about half the compile time) while the optimized one "
        "compiles in the background; those runs may differ from the optimized program's "
        "in the last bits (`executor/tiers.py`)"),
    Var("PT_XLA_TUNE_GC", "bool", True,
        "`0`: leave Python's garbage collector as it is (no `gc.freeze()`, no threshold change, no pause during imports)"),
    Var("PT_XLA_CPU_BLAS", "bool", True,
        "`0`: XLA computes every float32 matrix product of CPU programs (no call of PyTorch's BLAS)"),
    Var("PT_XLA_RETAIN_HOST_MEMORY", "str", "1",
        "the C heap on the CPU device: `1` one malloc arena that keeps every buffer resident; "
        "`threads` an arena per thread and temporary buffers cut to fit one (steps of small "
        "programs up to ~15% faster; a buffer over 64 MiB is mapped afresh at every step); "
        "`0` glibc's allocator as it is (no `mallopt`)"),
    Var("PT_XLA_PATCH_MODULE_APPLY", "bool", True,
        "`0`: do not wrap `torch.nn.Module._apply` (tied parameters may come untied by `.to(xla)`)"),
    Var("PT_XLA_LEAN_INPLACE_META", "bool", True,
        "`0`: do not cache the meta checks of in-place elementwise ops under functionalization"),
    Var("PT_XLA_FUNCTIONALIZE_COPY", "bool", True,
        "`0`: keep PyTorch's Functionalize kernel of `copy_` (then `cpu.copy_(xla)` fails)"),
    Var("PT_XLA_FUNCTIONALIZE_TO_COPY", "bool", True,
        "`0`: keep PyTorch's Functionalize kernel of `_to_copy` (`x.to(dtype)` is then unwrapped)"),
    Var("PT_XLA_PATCH_GRU", "bool", True,
        "`0`: leave `torch.nn.GRU` as it is (no scan-based GRU on xla tensors)"),
    Var("PT_XLA_PATCH_CLIP_GRAD_NORM", "bool", True,
        "`0`: leave `torch.nn.utils.clip_grad_norm_` as it is (with no gradient it returns a CPU zero)"),
    Var("PT_XLA_LOAD_TO_DEVICE", "bool", True,
        "`0`: leave `torch.load`'s deserializers as they are (then `map_location='xla'` of CPU tensors "
        "reaches PyTorch's PrivateUse1 one, which crashes the process)"),
    Var("PT_XLA_MARK_SHARDING_IN_GRAPH", "bool", True,
        "`0`: `xs.mark_sharding` inside `torch.compile` stays a graph break (no Dynamo stand-in)"),
    Var("PT_XLA_LAZY_DYNAMO_DISABLE", "bool", True,
        "`0`: let PyTorch's meta kernels import `torch._dynamo` on their first call"),
    Var("PT_XLA_LAZY_OPTIMIZER_DYNAMO", "bool", True,
        "`0`: let torch.optim's `step` import `torch._dynamo` on its first call"),
    Var("PT_XLA_LAZY_SYMBOLIC_SHAPES", "bool", True,
        "`0`: let `torch._check` and the meta kernels import `torch.fx.experimental.symbolic_shapes` (and sympy) "
        "on their first call"),
    Var("TORCH_XLA_JAX_PROCESS_ID", "int", None, "set by the launcher: this process's rank", cached=False),
    Var("TORCH_XLA_JAX_WORLD_SIZE", "int", None, "set by the launcher: number of processes", cached=False),
    Var("TORCH_XLA_JAX_LOCAL_RANK", "int", None, "set by the launcher: rank on this host", cached=False),
    Var("TORCH_XLA_JAX_LOCAL_WORLD_SIZE", "int", None,
        "set by the launcher: processes on this host", cached=False),
    Var("TORCH_XLA_JAX_COORDINATOR", "str", None,
        "`host:port` of the job's coordination service (set by the launcher)", cached=False),
    Var("TORCH_XLA_JAX_KILL_GRACE_S", "float", 5.0,
        "seconds the launcher waits after SIGTERM before SIGKILL when a replica fails"),
    Var("RANK", "int", None, "torchrun: global rank", cached=False),
    Var("WORLD_SIZE", "int", None, "torchrun: number of processes", cached=False),
    Var("LOCAL_RANK", "int", None, "torchrun: rank on this host", cached=False),
    Var("LOCAL_WORLD_SIZE", "int", None, "torchrun: processes on this host", cached=False),
    Var("MASTER_ADDR", "str", None, "torchrun: the master host (coordinator on MASTER_PORT+1)",
        cached=False),
    Var("MASTER_PORT", "str", None, "torchrun: the master's store port", cached=False),
    Var("JAX_PLATFORMS", "str", "", "jax's platform list (set from PJRT_DEVICE when unset)", cached=False),
    Var("DEBUG", "bool", False, "`torch_xla.utils.utils.get_print_fn`: print when set", cached=False),
    Var("MODELCMP_SAVEDIR", "str", None,
        "`torch_xla.debug.model_comparator.save`: the folder tensors are saved in (unless `configure`d)",
        cached=False),
    # ---- TPU topology (`torch_xla._internal.tpu`: read before the runtime starts) ----
    Var("TPU_SKIP_MDS_QUERY", "bool", False,
        "`1`: read the TPU host's facts from the `TPU_*` variables below instead of the GCE metadata server",
        cached=False),
    Var("TPU_ACCELERATOR_TYPE", "str", None, "with `TPU_SKIP_MDS_QUERY`: the slice's type (`v4-16`)", cached=False),
    Var("TPU_HOST_BOUNDS", "str", None, "with `TPU_SKIP_MDS_QUERY`: the grid of hosts (`1,1,2`)", cached=False),
    Var("TPU_CHIPS_PER_HOST_BOUNDS", "str", None, "with `TPU_SKIP_MDS_QUERY`: the grid of chips per host (`2,2,1`)",
        cached=False),
    Var("TPU_WORKER_ID", "str", None, "with `TPU_SKIP_MDS_QUERY`: this host's index in the slice", cached=False),
    Var("TPU_WORKER_HOSTNAMES", "str", None,
        "with `TPU_SKIP_MDS_QUERY`: the slice's hosts, comma-separated, in worker order", cached=False),
    Var("TPU_PROCESS_BOUNDS", "str", None,
        "libtpu: the grid of processes over the slice (set per process by `configure_topology` unless set)",
        cached=False),
    Var("TPU_CHIPS_PER_PROCESS_BOUNDS", "str", None,
        "libtpu: the grid of chips each process drives (`1,1,1` per process unless set)", cached=False),
    Var("CLOUD_TPU_TASK_ID", "int", None, "libtpu: this process's index among the slice's processes",
        cached=False),
    Var("TPU_VISIBLE_CHIPS", "str", None, "libtpu: the chips of this host this process uses", cached=False),
    Var("TPU_PROCESS_ADDRESSES", "str", None, "libtpu: `host:port` of every process of the slice",
        cached=False),
    Var("TPU_PROCESS_PORT", "str", None, "libtpu: this process's port", cached=False),
    # ---- debugging (docs/ARCHITECTURE.md, "Debugging") ----
    Var("PT_XLA_DEBUG_LEVEL", "int", -1,
        "`1`: a compilation analysis at every compile (cause, graph hash, inputs/outputs, Python frames, "
        "and what changed since the closest graph compiled before); `2`: an execution analysis at every "
        "run too; a summary at exit"),
    Var("PT_XLA_DEBUG", "bool", False, "the analyses of `PT_XLA_DEBUG_LEVEL=2`"),
    Var("PT_XLA_DEBUG_FILE", "str", "", "append the analyses to this file instead of stderr"),
    Var("PT_XLA_DEBUG_MAX_FRAME", "int", 8, "Python frames shown per analysis"),
    Var("XLA_IR_DEBUG", "bool", False,
        "record each traced op's Python source line; the IR text (`_get_xla_tensors_text`, "
        "`XLA_SAVE_TENSORS_FILE`) shows it"),
    Var("XLA_SAVE_TENSORS_FILE", "str", "",
        "append the graph of every execution to this file, named with the process's device ordinal "
        "appended (`graphs.txt.0`); SPMD programs in the `hlo` format add their outputs' shardings"),
    Var("XLA_SAVE_TENSORS_FMT", "str", "text", "format of `XLA_SAVE_TENSORS_FILE`: `text` (IR), `hlo` or `dot`"),
    Var("XLA_DUMP_POST_OPTIMIZATIONS", "bool", False,
        "the HLO text of `_get_xla_tensors_hlo` and of `XLA_SAVE_TENSORS_FMT=hlo` is the compiled "
        "program after XLA's optimizations (SPMD: partitioned, with its collectives)", cached=False),
    Var("XLA_METRICS_FILE", "str", "", "append the metrics report to this file at every step"),
    Var("XLA_SAVE_HLO_FILE", "str", "", "write the program whose compilation or execution failed to this file"),
    Var("XLA_DUMP_HLO_GRAPH", "bool", False, "add the program to the error of a failed compilation or execution"),
    Var("XLA_SYNC_WAIT", "bool", False, "every barrier waits for its programs to finish"),
    Var("XLA_USE_EAGER_DEBUG_MODE", "bool", False, "run every op as it is traced (eager mode) from the start"),
    Var("XLA_PERSISTENT_CACHE_PATH", "str", "",
        "directory of the persistent compile cache (`xr.initialize_cache(path)` at import)"),
    Var("XLA_DYNAMO_DEBUG", "bool", False,
        "print what the dynamo bridge does with each FX graph (traced, compiled, run lazily)"),
    Var("XLA_DYNAMO_ONE_PROGRAM", "bool", True,
        "`0`: each `torch.compile(backend='openxla')` graph of a training step (AOTAutograd's "
        "forward and backward) runs its program at once, instead of being applied as one pending "
        "IR node so that forward, backward and optimizer compile into one program per step at the "
        "barrier (read when Dynamo hands a graph to the bridge; a graph outside a training step "
        "runs at once when its inputs are computed)"),
    Var("PT_XLA_PRINT_KERNELS", "str", "",
        "`1`: print the source of each specialised kernel to stderr when it is generated (an "
        "overload's first call, `kernels/specialise.py`); or a comma-separated list of the ops "
        "to print, e.g. `aten::add.Tensor,mm` (with or without `aten::` and the overload)"),
    Var("TF_CPP_MIN_LOG_LEVEL", "str", "", "XLA's own C++ logging level (read by jaxlib as is)", cached=False),
    Var("TF_CPP_VMODULE", "str", "", "XLA's own per-file verbose logging (read by jaxlib as is)", cached=False),
    Var("TF_CPP_LOG_THREAD_ID", "str", "", "thread ids in XLA's own C++ logs (read by jaxlib as is)",
        cached=False),
    Var("XLA_DISABLE_FUNCTIONALIZATION", "bool", False,
        "functionalization stays on (it is how this engine sees every op); set, the errors PyTorch/XLA "
        "words differently without it take that wording (`expand` to an incompatible size)"),
]
VARS: Dict[str, Var] = {v.name: v for v in _VARS}
_cache: Dict[str, Any] = {}
FALSE_WORDS = ("", "0", "false", "no", "off")


def _parse(var: Var, raw: Optional[str]) -> Any:
    if raw is None or (raw == "" and var.kind != "str"):
        return var.default
    if var.kind == "bool":
        return raw.strip().lower() not in FALSE_WORDS
    if var.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {var.name}={raw!r} is not an integer") from None
    if var.kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"environment variable {var.name}={raw!r} is not a number") from None
    return raw


def get(name: str) -> Any:
    """The parsed value of a registered variable (its default when unset)."""
    var = VARS[name]
    if var.cached:
        try:
            return _cache[name]
        except KeyError:
            pass
    value = _parse(var, os.environ.get(name))
    if var.cached:
        _cache[name] = value
    return value


def raw(name: str) -> Optional[str]:
    """The variable's text as set (None when unset)."""
    return os.environ.get(VARS[name].name)


def is_set(name: str) -> bool:
    return raw(name) not in (None, "")


def reload() -> None:
    """Forgets the parsed settings: the next `get` reads the environment again."""
    _cache.clear()


def getenv_as(name: str, vtype: type, default: Any = None) -> Any:
    """Any environment variable as `vtype` (the public `xu.getenv_as`)."""
    text = os.environ.get(name)
    if text is None:
        return default
    if vtype is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on", "y", "t"):
            return True
        if low in ("0", "false", "no", "off", "n", "f", ""):
            return False
        raise ValueError(f"environment variable {name}={text!r} is not a boolean")
    return vtype(text)


def environ_items() -> Mapping[str, str]:
    """A copy of the whole environment (for reports that list it)."""
    return dict(os.environ)


def reread(name: str) -> Any:
    """The variable's value read from the environment again (the runtime's start reads
    PJRT_DEVICE as it is then, not as it was at import)."""
    _cache.pop(name, None)
    return get(name)


# ---- the few places that write the environment ---------------------------------------------

def set_default(name: str, value: str) -> None:
    """Sets a variable unless it is already set (for libraries read after us: jax, XLA)."""
    os.environ.setdefault(name, value)
    _cache.pop(name, None)


def add_xla_flag(flag: str) -> None:
    """Appends `--flag` to XLA_FLAGS unless the flag's name is already there."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0].lstrip("-") not in flags:
        os.environ["XLA_FLAGS"] = (flags + f" --{flag.lstrip('-')}").strip()


def update(env: Mapping[str, str]) -> None:
    """Sets several variables (a launched replica's environment)."""
    os.environ.update(env)
    for k in env:
        _cache.pop(k, None)


@contextlib.contextmanager
def overlay(env: Mapping[str, str]) -> Iterator[None]:
    """Sets `env` for the duration of the block, then restores what was there."""
    saved = {k: os.environ.get(k) for k in env}
    update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
            _cache.pop(k, None)


@contextlib.contextmanager
def kept(names: Iterable[str]) -> Iterator[None]:
    """Whatever the block does to these variables (an imported library setting its own) is
    undone at its end."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if os.environ.get(k) != v:
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
                _cache.pop(k, None)


def refused_set() -> Dict[str, str]:
    """The variables that are set but cannot apply here, with the reason."""
    return {v.name: v.refused for v in _VARS if v.refused and os.environ.get(v.name) not in (None, "")}


def table() -> str:
    """The registry as a markdown table (README)."""
    rows = ["| variable | meaning |", "| --- | --- |"]
    rows += [f"| `{v.name}` | {v.meaning} |" for v in _VARS]
    return "\n".join(rows)
