"""`xla` process groups over parts of the world, and collectives kept in one-replica
programs (XLA_ALWAYS_ALLREDUCE).

Results are compared with the values computed on the CPU from the group members'
inputs (a replica's input depends only on its rank).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_xla._engine import launcher

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mp_scripts import group_workers  # noqa: E402
from mp_scripts.workers import rank_input  # noqa: E402

REPO = os.path.dirname(HERE)


def _check(res, n):
    for r in range(n):
        o = res[r]
        torch.testing.assert_close(o["single_all_reduce"], rank_input(r))
        torch.testing.assert_close(o["single_broadcast"], rank_input(r))
        if n >= 4:
            groups = {"pair": [[2 * i, 2 * i + 1] for i in range(n // 2)],
                      "strided": [list(range(j, n, n // 2)) for j in range(n // 2)]}
            for name, gs in groups.items():
                g = next(g for g in gs if r in g)
                torch.testing.assert_close(o[f"{name}_all_reduce"], sum(rank_input(m) for m in g))
                for part, m in zip(o[f"{name}_all_gather"], g):
                    torch.testing.assert_close(part, rank_input(m))
                assert o[f"{name}_objects"] == [f"r{m}" for m in g]
    src, got = res[0]["recv_any"]
    assert src == 1
    torch.testing.assert_close(got, rank_input(1))


def test_single_rank_groups_and_recv_any_source_2_processes():
    res = launcher.spawn(group_workers.subgroup_job, nprocs=2, return_results=True)
    _check(res, 2)


@pytest.mark.slow
def test_pair_and_strided_groups_4_processes():
    res = launcher.spawn(group_workers.subgroup_job, nprocs=4, return_results=True)
    _check(res, 4)


_ONE_PROCESS = textwrap.dedent(r"""
    import os, re
    from unittest import mock
    os.environ['XLA_ALWAYS_ALLREDUCE'] = '1'
    import torch, torch.distributed as dist, torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_backend as xb
    dist.init_process_group('xla', init_method='xla://')
    dev = torch_xla.device()
    t = torch.arange(4., device=dev) + 1
    dist.all_reduce(t)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([t])
    print('AR', len(re.findall(r'all-reduce\(', hlo)), t.cpu().tolist())
    g = xm.all_gather(torch.arange(3, device=dev))
    print('AG', 'all-gather(' in torch_xla._XLAC._get_xla_tensors_hlo([g]), g.cpu().tolist())
    # A group of a pretended world of 6: its program can be printed, not run.
    with mock.patch.object(dist.group.WORLD, 'size', return_value=6), \
         mock.patch.object(dist.group.WORLD, 'rank', return_value=3):
        pg = dist.new_group(ranks=[2, 3])
        print('MESH', pg._mesh)
        u = torch.ones(2, device=dev)
        pg.allreduce([u], dist.AllreduceOptions())
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([u])
        print('GROUPS', 'replica_groups={{0,1},{2,3},{4,5}}' in hlo)
        try:
            u.cpu()
        except RuntimeError as e:
            print('RUN', 'beyond' in str(e))
        for bad in ([3, 4], [1, 3]):  # not one group of an even partition
            try:
                dist.new_group(ranks=bad,
                               pg_options={'xla_pg_options': {'spmd': True}})
                print('BAD accepted', bad)
            except ValueError:
                print('BAD refused')
    os.environ['XLA_ALWAYS_ALLREDUCE'] = '0'
    v = torch.ones(2, device=dev) * 2
    dist.all_reduce(v)
    print('OFF', 'all-reduce(' in torch_xla._XLAC._get_xla_tensors_hlo([v]), v.cpu().tolist())
""")


def test_always_allreduce_and_pretended_world_one_process():
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "WORLD_SIZE", "RANK")}
    env["PJRT_DEVICE"] = "CPU"
    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    lines = out.stdout
    assert "AR 1 [1.0, 2.0, 3.0, 4.0]" in lines, out.stderr[-3000:]
    assert "AG True [0, 1, 2]" in lines
    assert "MESH [[0, 1], [2, 3], [4, 5]]" in lines
    assert "GROUPS True" in lines
    assert "RUN True" in lines
    assert len(re.findall("BAD refused", lines)) == 2
    assert "OFF False [2.0, 2.0]" in lines
