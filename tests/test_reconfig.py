"""The reconfiguration set (scaled-down UCP paper experiments), run in-process on sub-groups: every
transition of at most 4 ranks in one 4-process spawn, and two 8-rank ones in one 8-process spawn.
`make reconfig` runs the whole set in fresh processes per job, with timings."""

import contextlib
import io
import json
import time

import pytest
import torch.distributed as dist

import dist as D
from parallel import build_job
from reconfig import TRANSITIONS

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

EIGHT_RANK = [("dp=2,tp=2,pp=2", "dp=2,tp=2"), ("dp=2,tp=2,ep=2", "dp=4,ep=2")]


def _transitions_worker(rank, world, root, transitions, steps):
    import os

    import elastic_resume as er

    os.environ["UCP_DCP_HOST"] = f"node{rank // 2}"  # two simulated hosts of two ranks: read-once sends across

    er.quiet_logs()
    out = []
    for i, (save, load) in enumerate(transitions):
        t0 = time.perf_counter()
        a = er._args(["--save-topology", save, "--load-topology", load, "--steps", str(steps), "--out", f"{root}/{i}"])
        import os

        os.makedirs(a.out, exist_ok=True)
        for phase, topo, fn in (("save", a.save_topo, er.save_phase), ("load", a.load_topo, er.load_phase)):
            job = build_job(topo, list(range(topo.world)))  # every rank builds every job's groups
            if job.member:
                fn(a, job)
            dist.barrier()
        if rank == 0:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = er.report(a)
            io_stats = json.loads(open(f"{a.out}/load.json").read())["io"]
            out.append((f"{save} -> {load}", code, buf.getvalue().strip().splitlines()[-1], time.perf_counter() - t0,
                        io_stats))
    return out


def _check(results):
    bad = [r for r in results if r[1] != 0 or not r[2].startswith("RESUME OK")]
    for label, code, verdict, dt, _ in results:
        print(f"{label:<34} {dt:5.1f}s {verdict}")
    assert not bad, "\n".join(f"{r[0]}: {r[2]}" for r in bad)


def test_reconfig_set_up_to_4_ranks():
    small = [t for t in TRANSITIONS if max(_world(t[0]), _world(t[1])) <= 4]
    assert len(small) == 10
    results = D.run(_transitions_worker, 4, D.tmpdir(), small, 2)[0]
    _check(results)
    # loading HSDP (2 replicas of each FSDP shard, one per simulated host): no saved item is read on
    # both hosts; the other host's replica arrives from the reader instead of storage
    hsdp = next(r for r in results if r[0] == "dp=4 -> dpr=2,dp=2")[4]
    assert hsdp["hosts"] == 2 and hsdp["items_read_on_several_hosts"] == 0, hsdp
    assert hsdp["bytes_received"] > 0.5 * hsdp["bytes_read"] > 0, hsdp


def test_reconfig_two_8_rank_transitions():
    assert all(t in TRANSITIONS for t in EIGHT_RANK)
    _check(D.run(_transitions_worker, 8, D.tmpdir(), EIGHT_RANK, 2)[0])


def _world(text):
    from parallel import Topology

    return Topology.parse(text).world
