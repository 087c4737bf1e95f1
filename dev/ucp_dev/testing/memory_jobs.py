"""The memory tier's jobs on the toy trainer, for the tests, ``make memory-demo`` and the benchmark: a
job that trains and saves generations into the memory tier (optionally dying at a step), a simulated
host loss, and a restarted job at another layout that loads from the freshest complete tier.

Hosts are simulated by ``UCP_DCP_HOST``: rank ``r`` of a job with ``per_host`` ranks per host is on
``node<r // per_host>``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist

from ucp_dcp.memory import MemoryTier
from ucp_dcp.memory import load as memory_load
from ucp_dcp.memory.store import host_dir
from ucp_dcp.planning.load_planner import UCPLoadPlanner
from ucp_dcp.planning.save_planner import UCPSavePlanner
from ucp_dev.testing.checks import state_diffs
from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, trainer_options

__all__ = ["simulate_hosts", "save_job", "lose_hosts", "resume_job"]


def simulate_hosts(hosts: str) -> str:
    """Put this rank on its simulated host: ``hosts`` lists each rank's, e.g. ``"0,0,1,1"`` (node0, node1)."""
    host = f"node{hosts.split(',')[dist.get_rank()]}"
    os.environ["UCP_DCP_HOST"] = host
    return host


def save_job(
    topo: str,
    root: str,
    durable: str | None,
    *,
    saves: int = 2,
    fault: Any = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """Train one step before each of ``saves`` memory saves; the last save runs with ``fault`` (every rank
    stops at that step). Returns, on every rank, the oracle of every save (logical state, no ucp_dcp code)
    and the background status of each."""
    cfg = ModelConfig()
    job = build_job(Topology.parse(topo))
    tr = build_trainer(cfg, job, seed=0)
    oracles, statuses, blocked = [], [], []
    tier = MemoryTier(root, durable=durable, replicas=replicas, process_group=job.group)
    try:
        for i in range(saves):
            train_step(tr)
            last = i == saves - 1
            tier.fault = fault if last else None
            oracles.append(logical_state(tr))
            try:
                tier.save(tr.state_dict(), planner=UCPSavePlanner(**trainer_options(cfg, tr)), step=tr.step)
            except Exception as e:  # the fault during the host copy: the save itself fails
                statuses.append({"gen": tier.next_gen - 1, "complete": False, "error": type(e).__name__})
                break
            blocked.append(tier.blocked_s)
            s = tier.wait()
            assert s is not None
            statuses.append(
                {
                    "gen": s.gen,
                    "complete": s.complete,
                    "drained": s.drained,
                    "error": repr(s.error) if s.error else None,
                }
            )
    finally:
        tier.close()
    return {"oracles": oracles, "statuses": statuses, "blocked": blocked}


def lose_hosts(root: str, hosts: list[str]) -> None:
    """A host is lost: its memory store is gone (call on one rank)."""
    for h in hosts:
        shutil.rmtree(host_dir(root, h), ignore_errors=True)


def resume_job(topo: str, root: str, durable: str | None, oracle: dict | None) -> dict[str, Any]:
    """A job at ``topo`` from another seed loads the freshest complete tier; its logical state is compared
    with ``oracle`` bitwise. Returns the tier, generation, notes, per-rank serving and differences."""
    cfg = ModelConfig()
    job = build_job(Topology.parse(topo))
    tr = build_trainer(cfg, job, seed=1)  # every value must come from the checkpoint
    sd = tr.state_dict()
    src = memory_load(
        sd, root, durable=durable, planner=UCPLoadPlanner(**trainer_options(cfg, tr)), process_group=job.group
    )
    tr.load_state_dict(sd)
    loaded = logical_state(tr)
    stats = src.stats
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (getattr(stats, "bytes_read", 0), getattr(stats, "bytes_received", 0)))
    return {
        "tier": src.tier,
        "generation": src.generation,
        "notes": src.notes,
        "serving": src.serving(),
        "diffs": state_diffs(oracle, loaded) if oracle is not None else None,
        "step": tr.step,
        "bytes": got,
    }
