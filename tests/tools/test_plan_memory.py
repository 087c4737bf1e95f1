"""``ucp_dcp plan`` pointed at a memory-tier root: the generation a restart on the given hosts would load,
and which tier serves each rank. The root comes from a real 2-host memory save (the shared gloo pool);
the plan runs in this process, as the command does."""

import json
import shutil

import dist as D
import pytest

from ucp_dcp.memory.store import host_dir
from ucp_dev.testing.memory_jobs import save_job, simulate_hosts
from ucp_dev.toy.plan_target import TARGET

pytestmark = pytest.mark.slow


def _save(rank, world, root, durable):
    simulate_hosts("0,1")
    return save_job("tp=2", root, durable, saves=1)


def _plan(capsys, root, *args):
    from ucp_dcp.__main__ import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCP_TOY_TOPOLOGY", "tp=2")
        argv = ["plan", root, "--target", TARGET, "--world-size", "2", "--ranks-per-node", "1", *args, "--json", "-"]
        rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


def test_plan_on_a_memory_root_names_the_tier_serving_each_rank(capsys):
    root, disk = D.tmpdir(), D.tmpdir()
    D.run(_save, 2, root, disk)
    shutil.rmtree(host_dir(root, "node1"))  # node1 is lost; node0 keeps its replica
    rc, report = _plan(capsys, root, "--hosts", "node0,node5")
    assert rc == 0 and report["loads"], report["problems"]
    assert "memory generation 1" in report["checkpoint"]
    assert [r["source"] for r in report["ranks"]] == ["own host memory (node0)", "peer host memory (node0) for node5"]
    # a restart on two fresh hosts: nothing in their memory, the durable copy
    rc, report = _plan(capsys, root, "--hosts", "node7,node5", "--durable", disk)
    assert rc == 0 and "durable generation 1" in report["checkpoint"]
    assert {r["source"] for r in report["ranks"]} == {"durable"}
