"""The elastic-resume check the multi-process tests run in-process on the pool (the save and load
phases of ``recipes/elastic_resume.py``, returning their figures instead of writing files), and its
helpers. The model, trainer and oracle are ``ucp_dcp.toy``'s, the ones the recipes use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plan_check import gather, rank_stats

from ucp_dcp.toy import Job, ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, trainer_options

# fp32 tolerances for a resume at a *different* layout (reduction order differs; same layout must be bitwise):
# relative loss difference at the first resumed step and at the last step.
TOL_FIRST = 1e-5
TOL_LAST = 1e-4


def compare_state(oracle: dict, loaded: dict) -> list[str]:
    """Names of entries that are not bitwise equal (or missing on one side)."""
    diffs = sorted(set(oracle) ^ set(loaded))
    for k in sorted(set(oracle) & set(loaded)):
        a, b = oracle[k], loaded[k]
        if any(isinstance(x, str) and x == "<copies differ>" for x in (a, b)):
            same = False
        elif isinstance(a, torch.Tensor):
            same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            same = a == b
        if not same:
            diffs.append(k)
    return diffs


def io_stats(reader, job: Job) -> dict | None:
    """Storage traffic of a load over the job's ranks (``UCPFileSystemReader`` only; collective over the job)."""
    import os
    import socket

    stats = getattr(reader, "stats", None)
    host = os.environ.get("UCP_DCP_HOST") or socket.gethostname()
    mine = (stats.bytes_read, stats.bytes_received, sorted(set(stats.items)), host) if stats is not None else None
    everyone: list = [None] * dist.get_world_size(job.group)
    dist.all_gather_object(everyone, mine, group=job.group)
    if any(x is None for x in everyone):
        return None
    ranks: dict[str, int] = {}
    hosts: dict[str, set] = {}
    for _, _, items, h in everyone:
        for key in items:
            ranks[key] = ranks.get(key, 0) + 1
            hosts.setdefault(key, set()).add(h)
    return {
        "bytes_read": sum(x[0] for x in everyone),
        "bytes_received": sum(x[1] for x in everyone),
        "items": len(ranks),
        "items_read_by_several_ranks": sum(1 for n in ranks.values() if n > 1),
        "hosts": len({x[3] for x in everyone}),
        "items_read_on_several_hosts": sum(1 for h in hosts.values() if len(h) > 1),
    }


def elastic_resume(save: Topology, load: Topology, steps: int, folder: str) -> dict | None:
    """The elastic-resume recipe in one process world (every rank calls this; jobs on ranks
    0..world-1 of each topology): train ``steps`` steps at ``save``, save with ucp_dcp, keep the
    oracle, train on to 2 x ``steps`` (the reference); then a fresh trainer (another init) at
    ``load`` loads, is compared with the oracle bitwise and trains ``steps`` steps. Returns, on rank
    0, the figures :func:`resume_problems` judges; None elsewhere."""
    import ucp_dcp

    cfg = ModelConfig()
    out: dict = {"save": str(save), "load": str(load)}
    oracle = None
    job = build_job(save, list(range(save.world)))  # every rank builds every job's groups
    if job.member:
        tr = build_trainer(cfg, job, seed=0)
        losses = [train_step(tr) for _ in range(steps)]
        dcp.save(
            tr.state_dict(),
            storage_writer=ucp_dcp.UCPFileSystemWriter(f"{folder}/ckpt"),
            process_group=job.group,
            planner=ucp_dcp.UCPSavePlanner(**trainer_options(cfg, tr)),
        )
        oracle = logical_state(tr)
        out["reference"] = losses + [train_step(tr) for _ in range(steps)]
    dist.barrier()
    job = build_job(load, list(range(load.world)))
    if job.member:
        tr = build_trainer(cfg, job, seed=1)  # different init: every value must come from the checkpoint
        sd = tr.state_dict()
        reader = ucp_dcp.UCPFileSystemReader(f"{folder}/ckpt")
        dcp.load(
            sd,
            storage_reader=reader,
            process_group=job.group,
            planner=ucp_dcp.UCPLoadPlanner(**trainer_options(cfg, tr)),
        )
        tr.load_state_dict(sd)
        out["io"] = io_stats(reader, job)
        out["load_stats"] = gather(rank_stats(reader), job.group)  # what tests/tools/test_dryrun_reconfig.py plans
        out["ckpt"] = f"{folder}/ckpt"
        loaded = logical_state(tr)
        out["state_diffs"] = compare_state(oracle, loaded) if oracle is not None else None
        out["entries"] = len(loaded)
        out["resumed"] = [train_step(tr) for _ in range(steps)]
    dist.barrier()
    return out if dist.get_rank() == 0 else None


def resume_problems(r: dict, steps: int) -> list[str]:
    """What the recipe's report calls a RESUME MISMATCH: loaded state not bitwise the oracle; losses
    not bitwise at the same layout, or beyond the fp32 tolerances at another."""
    problems = []
    if r["state_diffs"]:
        problems.append(
            f"{len(r['state_diffs'])} of {r['entries']} loaded entries differ from the oracle "
            f"({', '.join(r['state_diffs'][:5])})"
        )
    ref, res = r["reference"], r["resumed"]
    if r["save"] == r["load"]:
        if res != ref[steps:]:
            problems.append("same layout but losses are not bitwise equal")
    else:
        rels = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(res, ref[steps:])]
        if rels[0] > TOL_FIRST:
            problems.append(f"first resumed step rel diff {rels[0]:.2e} > {TOL_FIRST:g}")
        if rels[-1] > TOL_LAST:
            problems.append(f"step {2 * steps} rel diff {rels[-1]:.2e} > {TOL_LAST:g}")
    return problems
