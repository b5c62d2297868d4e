"""Shared machinery of the benchmarks: timing, medians, RSS from /proc, compile statistics,
subprocess isolation of the contenders, markdown tables.

Every benchmark script has two roles:
  parent  `python bench/bench_X.py [--quick] [--original-venv PATH]` starts one fresh
          subprocess per contender (`--worker NAME`), so peak RSS and compile counts are
          per contender, and prints a markdown table with medians and ratios;
  worker  runs one contender and prints one line `BENCH_RESULT {json}`.

Contenders:
  xla       this project (torch_xla API on jax), the current interpreter
  eager     eager PyTorch on the CPU, 2 threads
  jax       the same model written directly in jax (bench/models_jax.py)
  original  torch_xla 2.9 (the `xla` worker run by PATH/bin/python of --original-venv)

The `xla` worker code uses only the documented torch_xla API (torch_xla.device(),
xm.mark_step(), xm.wait_device_ops(), torch_xla.debug.metrics) so that it runs unchanged
under the original. This module imports only the standard library, torch is imported by the
workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULT_TAG = "BENCH_RESULT "

LABELS = {
    "xla": "torch-xla-jax (this project)",
    "eager": "torch eager CPU (2 threads)",
    "jax": "pure jax (jax.jit)",
    "original": "torch_xla 2.9 (original)",
}

# Process start, as early as this module is imported (workers import it first).
PROCESS_T0 = time.time()


# ---------------------------------------------------------------------------------------
# measuring

def now() -> float:
    return time.perf_counter()


def load_average() -> str:
    """The machine's 1/5/15-minute load averages, as printed beside each figure."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    """Current resident set size of this process, MiB (VmRSS)."""
    return _proc_status_kb("VmRSS") / 1024.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MiB (VmHWM)."""
    return _proc_status_kb("VmHWM") / 1024.0


def process_start_time() -> float:
    """Wall-clock time (time.time()) at which this process started, from /proc."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / hz
    except Exception:
        return PROCESS_T0


def set_threads():
    import torch
    torch.set_num_threads(2)


# ---------------------------------------------------------------------------------------
# compile statistics

class XlaCompileStats:
    """CompileTime metric of torch_xla.debug.metrics (this project or the original)."""

    def __init__(self):
        import torch_xla.debug.metrics as met
        self.met = met

    def snapshot(self):
        """(count, total seconds) of compilations so far."""
        data = self.met.metric_data("CompileTime")
        if not data:
            return 0, 0.0
        return int(data[0]), float(data[1]) / 1e9

    # `.item()` (the benchmarks' host read of the loss) is counted as
    # aten::_local_scalar_dense by the original too: a host read, not an op run on the CPU.
    HOST_READS = ("aten::_local_scalar_dense",)

    def fallback_ops(self):
        ops = None
        f = getattr(self.met, "executed_fallback_ops", None)
        if f is not None:
            try:
                ops = list(f())
            except Exception:
                ops = None
        if ops is None:
            ops = [c for c in self.met.counter_names() if c.startswith("aten::")]
        return [o for o in ops if o not in self.HOST_READS]


def xla_sync_device():
    import torch_xla.core.xla_model as xm
    xm.wait_device_ops()


def xla_training_step(wl, barrier: bool = True):
    """A workload's training step on the xla device (this project or the original, through
    the documented API only): weights from torch.manual_seed(0), one fixed batch, the
    workload's optimizer. Returns step() -> loss; each step ends with xm.mark_step()
    unless `barrier` is False (the step is then only traced)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model().to(dev)
    model.train()
    opt = wl.make_opt(model.parameters())
    x, y = wl.make_batch(0)
    x, y = x.to(dev), y.to(dev)

    def step():
        opt.zero_grad()
        loss = wl.loss_fn(model, x, y)
        loss.backward()
        opt.step()
        if barrier:
            xm.mark_step()
        return loss
    return step


def traced_step_graph(wl, inference: bool = False):
    """This project only, for experiments that lower one step several ways: a workload's
    step (forward only with `inference`) traced on the xla device after two executed
    steps (the optimizer's state exists from step 2 on) and left pending. Returns the
    engine's Graph of the pending values and its parameter arrays."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch_xla._engine import executor, ir
    from torch_xla._engine.tensor import pending
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = wl.make_model().to(dev)
    opt = wl.make_opt(model.parameters())
    x, y = wl.make_batch(0)
    x, y = x.to(dev), y.to(dev)

    def trace():
        if inference:
            model.eval()
            with torch.no_grad():
                return model(x)
        opt.zero_grad()
        wl.loss_fn(model, x, y).backward()
        opt.step()
        return None

    for _ in range(2):
        trace()
        xm.mark_step()
    xm.wait_device_ops()
    out = trace()  # noqa: F841  (keeps the forward's result alive as a root)
    roots, seen = [], set()
    for s in pending.take_live():
        if type(s.node) is not ir.DeviceData and (id(s.node), s.idx) not in seen:
            seen.add((id(s.node), s.idx))
            roots.append((s.node, s.idx))
    graph = executor.Graph(roots)
    return graph, graph.param_values()


# ---------------------------------------------------------------------------------------
# worker side

def eager_training_step(wl, inductor: bool = False):
    """A closure running one eager CPU training step of workload `wl` (seed 0, one fixed
    batch); returns the loss. With `inductor`, the model is `torch.compile`d (inductor)."""
    import torch
    set_threads()
    torch.manual_seed(0)
    model = wl.make_model()
    model.train()
    opt = wl.make_opt(model.parameters())
    run = torch.compile(model) if inductor else model
    x, y = wl.make_batch(0)

    def step():
        opt.zero_grad()
        loss = wl.loss_fn(run, x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def emit(result: dict) -> None:
    """Prints a worker's result for the parent (one line)."""
    result.setdefault("peak_rss_mb", peak_rss_mb())
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------
# parent side

def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes and step counts (smoke test)")
    p.add_argument("--original-venv", default=None,
                   help="venv with torch-xla==2.9.0: adds the original as a contender")
    p.add_argument("--contenders", default=None,
                   help="comma-separated subset of xla,eager,jax,original")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-contender timeout, s")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-args", default="{}", help=argparse.SUPPRESS)
    return p


def contenders_of(args, available=("xla", "eager", "jax", "original")):
    wanted = args.contenders.split(",") if args.contenders else list(available)
    out = [c for c in wanted if c in available]
    if not args.original_venv:
        out = [c for c in out if c != "original" and not c.startswith("original_")]
    return out


def command_line() -> str:
    """The command that reproduces this run (what the tables print)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_DIR)
    return "PJRT_DEVICE=CPU python " + " ".join(shlex.quote(a) for a in [script] + sys.argv[1:])


def worker_env(original: bool) -> dict:
    env = dict(os.environ)
    env["PJRT_DEVICE"] = "CPU"
    env.setdefault("OMP_NUM_THREADS", "2")
    if original:
        # The original must not see this checkout's torch_xla.
        env.pop("PYTHONPATH", None)
    return env


_bytecode_ready = set()


def compile_bytecode(tree: str = REPO_DIR) -> None:
    """Writes the torch_xla bytecode (`__pycache__`) of checkout `tree` once, as `pip
    install` does for an installed package: without it (an editable checkout on a machine
    that sets PYTHONDONTWRITEBYTECODE) every worker would compile ~90 modules at import,
    ~0.08 s that no installed copy pays."""
    if tree not in _bytecode_ready:
        import compileall
        compileall.compile_dir(os.path.join(tree, "torch_xla"), quiet=1)
        _bytecode_ready.add(tree)


def run_worker(script: str, contender: str, args, worker_args: dict = None,
               extra_env: dict = None) -> dict:
    """Runs `script --worker contender` in a fresh subprocess, returns its result dict
    (with `error` set if it failed) and `wall_s` (the subprocess's wall time)."""
    # "original" runs the `xla` worker under the original; "original_NAME" its worker NAME.
    original = contender == "original" or contender.startswith("original_")
    if original:
        python = os.path.join(os.path.abspath(args.original_venv), "bin", "python")
        worker = "xla" if contender == "original" else contender[len("original_"):]
    else:
        python = sys.executable
        worker = contender
        compile_bytecode()
    cmd = [python, os.path.abspath(script), "--worker", worker,
           "--worker-args", json.dumps(worker_args or {})]
    if args.quick:
        cmd.append("--quick")
    env = worker_env(original)
    if extra_env:
        env.update(extra_env)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.timeout, cwd="/tmp" if original else REPO_DIR)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.timeout:.0f} s", "t_launch": t0}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
    if result is None or proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        result = dict(result or {})
        result["error"] = f"exit {proc.returncode}: " + " | ".join(tail)
    result["wall_s"] = time.time() - t0
    result["t_launch"] = t0
    return result


def fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}g}"
    return str(v)


def markdown_table(title: str, results: dict, columns: list, ratio_key: str = None,
                   higher_is_better: bool = True, command: str = None, notes=(),
                   labels: dict = None) -> str:
    """A markdown table: one row per contender (in `results` order), the `columns`
    [(key, header)], then, for `ratio_key`, one column "ratio vs C" per other contender
    (value / C's value when higher is better, C's value / value otherwise: >1 means better)."""
    label = dict(LABELS, **(labels or {}))
    names = list(results)
    heads = ["contender"] + [h for _, h in columns]
    ok = [n for n in names if ratio_key and results[n].get(ratio_key)]
    if ratio_key:
        heads += [f"x vs {n}" for n in ok]
    lines = [f"### {title}", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for n in names:
        r = results[n]
        row = [label.get(n, n)]
        if r.get("error") and not any(r.get(k) is not None for k, _ in columns):
            row += ["FAILED"] + ["-"] * (len(heads) - 2)
            lines.append("| " + " | ".join(row) + " |")
            continue
        row += [fmt(r.get(k)) for k, _ in columns]
        if ratio_key:
            for m in ok:
                a, b = r.get(ratio_key), results[m].get(ratio_key)
                if not a or not b:
                    row.append("-")
                else:
                    row.append(f"{(a / b if higher_is_better else b / a):.2f}")
        lines.append("| " + " | ".join(row) + " |")
    extra = list(notes)
    for n in names:
        r = results[n]
        if r.get("error"):
            extra.append(f"{label.get(n, n)} failed: {r['error'][:600]}")
        if r.get("fallback_ops"):
            extra.append(f"{label.get(n, n)} ran on the CPU fallback: {', '.join(r['fallback_ops'])}")
        if r.get("compiles_after_warmup"):
            extra.append(f"{label.get(n, n)}: {r['compiles_after_warmup']} compilation(s) after "
                         f"warm-up (steady state must compile nothing)")
    if extra:
        lines.append("")
        lines += [f"- {e}" for e in extra]
    lines.append("")
    return "\n".join(lines)


def parse_worker_args(args) -> dict:
    return json.loads(args.worker_args or "{}")
