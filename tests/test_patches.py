"""The patch registry: every entry installs through it, and each opt-out leaves its piece of
PyTorch (or of the process) untouched, while the entry left on changes it."""
import importlib
import json
import os
import subprocess
import sys

import pytest

from torch_xla._engine import env_vars, patches

# Run in a fresh process: the probe is evaluated before `import torch_xla`, right after it, and
# after the device has been used (phases IMPORT, JAX_START and STARTED have run). An entry is
# unchanged when both later values equal the first (a stand-in that PyTorch's own code replaces
# at its first real use, `lazy_symbolic_shapes`, shows only right after the import).
_PROBE = r"""
import ctypes, gc, json, sys
import torch

def _functionalize_line(op):
    return [l for l in torch._C._dispatch_dump_table(op).splitlines() if l.startswith("Functionalize")]

def _meta_line(op):
    return [l for l in torch._C._dispatch_dump_table(op).splitlines() if l.startswith("Meta")]

def _meta_path_hooks():
    return sorted(type(f).__name__ for f in sys.meta_path if "Dynamo" in type(f).__name__)

def _dynamo_disable_stand_ins():
    # Optimizer.state_dict is wrapped by torch._disable_dynamo: what its function holds
    # as the "don't trace" version (nothing until torch._dynamo builds it, or a stand-in).
    return type(getattr(torch.optim.Optimizer.state_dict.__wrapped__, "__dynamo_disable", None)).__name__

def _large_block_is_mmapped():
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(64 << 20)
    during = libc.mallinfo2().hblkhd
    libc.free(p)
    return during > before

def _arenas_unlimited():
    # a new thread's first allocation makes it an arena of its own unless the arena count
    # is limited (counted in malloc_info's report), and glibc's own limit (8 per core) lets
    # the threads jax starts have many
    import re, threading
    libc = ctypes.CDLL("libc.so.6")
    libc.open_memstream.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def arenas():
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        return len(re.findall(r"<heap nr=", buf.value.decode()))
    def allocate_and_stay(ready, stay):
        libc.free(libc.malloc(1024))
        ready.set()
        stay.wait()
    before = arenas()
    # the thread stays: an exiting thread's arena would be handed to the next new thread
    ready = threading.Event()
    threading.Thread(target=allocate_and_stay, args=(ready, threading.Event()), daemon=True).start()
    ready.wait()
    after = arenas()
    return after > before or after > 2

def _ffi_target_registered(name):
    from jax._src.lib import _jax
    return name in _jax.custom_call_targets("Host")

probes = json.loads(sys.argv[1])
before = {name: eval(probe) for name, probe in probes.items()}
import torch_xla
imported = {name: eval(probe) for name, probe in probes.items()}
import torch_xla.distributed.spmd  # noqa: F401  (entries installed by its import)
(torch.ones(2, device="xla") + 1).cpu()
after = {name: eval(probe) for name, probe in probes.items()}
same = lambda a, b: a is b or a == b
print(json.dumps({name: same(before[name], imported[name]) and same(before[name], after[name]) for name in probes}))
"""

OPT_OUTS = [p for p in patches.REGISTRY if p.opt_out in env_vars.VARS]


def test_every_opt_out_has_a_probe():
    assert OPT_OUTS, "no entry has an opt-out variable"
    assert [p.name for p in OPT_OUTS if p.probe is None] == []


@pytest.fixture(scope="module")
def probed():
    """{on: {entry: unchanged}}: every probe in a process with every opt-out at 1, and at 0."""
    out = {}
    for on in (True, False):
        env = dict(os.environ, PJRT_DEVICE="CPU")
        env.update({p.opt_out: "1" if on else "0" for p in OPT_OUTS})
        r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps({p.name: p.probe for p in OPT_OUTS})],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        out[on] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("entry", OPT_OUTS, ids=[p.name for p in OPT_OUTS])
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_opt_out_leaves_pytorch_untouched(probed, entry, on):
    unchanged = probed[on][entry.name]
    assert unchanged is (not on), f"{entry.name}: {entry.probe} {'unchanged' if unchanged else 'changed'}"


@pytest.mark.parametrize("entry", patches.REGISTRY, ids=[p.name for p in patches.REGISTRY])
def test_every_entry_names_an_installer_and_a_known_phase(entry):
    module, _, fn = entry.installer.partition(":")
    assert callable(getattr(importlib.import_module("torch_xla." + module), fn))
    assert entry.phase is None or entry.phase in patches.PHASES


def test_import_installs_the_import_phase_and_device_use_the_rest():
    import torch
    import torch_xla  # noqa: F401
    for p in patches.REGISTRY:
        if p.phase == patches.IMPORT and patches.enabled(p.name):
            assert patches.installed(p.name), p.name
    (torch.ones(2, device="xla") + 1).cpu()
    for p in patches.REGISTRY:
        if p.phase in (patches.JAX_START, patches.STARTED) and patches.enabled(p.name):
            assert p.name == "retain_host_memory" or patches.installed(p.name), p.name


def test_a_refused_patch_warns_and_is_not_installed(monkeypatch):
    monkeypatch.setattr(patches, "_installed", dict(patches._installed))
    patches._installed.pop("module_apply", None)
    from torch_xla._engine import process_patches
    monkeypatch.setattr(process_patches, "_orig_apply", lambda self, fn: None)  # another signature
    import torch
    before = torch.nn.Module._apply
    with pytest.warns(UserWarning, match="not patching torch.nn.Module._apply"):
        assert patches.install("module_apply") is False
    assert torch.nn.Module._apply is before


_NO_CHANGE_OUTSIDE = r"""
import atexit, sys, threading
import torch
import torch_xla
names = {t.name for t in threading.enumerate()}
print("xla-metrics-ready" in names, "torch_xla-tiered-compile" in names,
      "torch._dynamo" in sys.modules, torch.get_autocast_dtype("xla"))
"""


def test_import_starts_no_thread_and_imports_no_dynamo():
    r = subprocess.run([sys.executable, "-c", _NO_CHANGE_OUTSIDE], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "False", "False", "torch.bfloat16"]


@pytest.mark.parametrize("device", ["CUDA", "TPU"])
def test_pjrt_device_without_its_plugin_is_an_error_not_the_cpu(device):
    # jax is imported by `import torch_xla` (the lowerings), before PJRT_DEVICE is applied:
    # the `xla_flags` entry sets jax's option too, and a backend that cannot start is a
    # RuntimeError naming the extra to install, where PyTorch/XLA would not run either.
    code = ("import torch, torch_xla\n"
            "try:\n    (torch.ones(2, device='xla') + 1).cpu()\nexcept RuntimeError as e:\n    print('ERR', e)\n"
            "else:\n    print('RAN')\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # this process's own choice
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(env, PJRT_DEVICE=device))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith(f"ERR PJRT_DEVICE={device}: jax cannot start its '{device.lower()}' backend"), out
    assert f"torch-xla-jax[{device.lower()}]" in out
