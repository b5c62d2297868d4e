"""Two simulated hosts (processes) with 2 CPU devices each form one SPMD mesh."""
import json
import os
import subprocess
import sys

import numpy as np

from models import mlp, mlp_batches, train_classifier
from torch_xla._engine import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STEPS = 5


def _cpu_reference():
    model = mlp(32)
    losses = train_classifier(model, mlp_batches(STEPS))
    return losses, float(model[0].weight.sum())


def test_two_hosts_hybrid_mesh_trains_like_cpu():
    port = launcher.free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TORCH_XLA_JAX_") and k not in ("XLA_TEST_SPMD", "XLA_FLAGS")}
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", XLA_USE_SPMD="1", RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "scripts", "two_hosts.py"), str(STEPS)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
        r = json.loads(line[len("RESULT "):])
        results[r["rank"]] = r
    ref_losses, ref_w = _cpu_reference()
    assert sorted(results) == [0, 1]
    for r in results.values():
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["w_sum"], ref_w, rtol=1e-4, atol=1e-5)
