"""The toy trainer's elastic resume: train at one layout, save with ucp_dcp, resume at another, and the
verdict. One implementation for ``recipes/elastic_resume.py`` (each phase in its own processes, the figures
in files) and the multi-process tests (both phases in one process world, on sub-groups of the pool).

The save phase trains K steps, saves with ``UCPSavePlanner``, keeps an oracle of every *logical* value
(unfused, unpadded, global names; ``ucp_dev.toy.logical_state``, no ucp_dcp code) and trains on to step 2K:
the uninterrupted reference. The load phase builds a trainer from another seed (every value must come from
the checkpoint), loads with ``UCPLoadPlanner`` and trains K steps. :func:`resume_problems` judges the two:
the loaded state bitwise the oracle, and the losses bitwise at the same layout or within the fp32
tolerances of :mod:`ucp_dev.testing.checks` at another. :data:`RECONFIG_SET` is the set of transitions
``make reconfig``, the tests and the mistake set run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ucp_dcp.planning.load_planner import UCPLoadPlanner
from ucp_dcp.planning.save_planner import UCPSavePlanner
from ucp_dcp.storage.reader import UCPFileSystemReader
from ucp_dcp.storage.writer import UCPFileSystemWriter
from ucp_dev.testing.checks import loss_problems, rel_diffs, state_diffs, state_problem
from ucp_dev.toy import Job, ModelConfig, Topology, build_job, build_trainer, logical_state, train_step, trainer_options

RECONFIG_SET = [
    ("dp=2,tp=2,pp=2", "dp=2,tp=2"),
    ("dp=2,tp=2,pp=2", "tp=2,pp=2"),
    ("dp=2,tp=2,pp=2", "dp=4,pp=2"),
    ("tp=2,pp=2", "dp=2,tp=2,pp=2"),
    ("dp=4", "dp=2,tp=2"),
    ("dp=2,tp=2", "tp=4"),
    ("tp=4", "dp=4"),
    ("dp=2,pp=2", "pp=4"),
    ("pp=3", "pp=2"),
    ("pp=2,vpp=2", "dp=1"),
    ("dp=2,ep=2", "ep=4"),
    ("ep=4", "dp=4"),
    ("dp=2,tp=2,ep=2", "dp=4,ep=2"),
    ("dpr=2,dp=2", "dp=2,tp=2"),
    ("dp=4", "dpr=2,dp=2"),
]
"""The reconfiguration set, (save, load) topologies: the scaled-down experiments of the UCP paper."""


def _writer(storage: str, path: str):
    return UCPFileSystemWriter(path) if storage == "ucp" else dcp.FileSystemWriter(path)


def _reader(storage: str, path: str):
    return UCPFileSystemReader(path) if storage == "ucp" else dcp.FileSystemReader(path)


def save_phase(
    job: Job, folder: str, steps: int, storage: str = "ucp", checkpoint: str | None = None
) -> tuple[dict, list[float]]:
    """Every member of ``job``: train ``steps`` steps (seed 0), save to ``folder/ckpt`` or ``checkpoint`` (a
    folder or an object-store URL; ucp_dcp's planner; ``storage`` ``"ucp"``: its writer, ``"dcp"``: DCP's),
    take the oracle, train ``steps`` more. Returns the oracle and the 2 x ``steps`` reference losses."""
    cfg = ModelConfig()
    tr = build_trainer(cfg, job, seed=0)
    losses = [train_step(tr) for _ in range(steps)]
    dcp.save(
        tr.state_dict(),
        storage_writer=_writer(storage, checkpoint or f"{folder}/ckpt"),
        process_group=job.group,
        planner=UCPSavePlanner(**trainer_options(cfg, tr)),
    )
    oracle = logical_state(tr)
    losses += [train_step(tr) for _ in range(steps)]
    return oracle, losses


def load_phase(
    job: Job, folder: str, steps: int, storage: str = "ucp", corrupt: bool = False, checkpoint: str | None = None
) -> dict[str, Any]:
    """Every member of ``job``: a trainer from another seed loads ``folder/ckpt`` (or ``checkpoint``) and trains
    ``steps`` steps.
    Returns ``loaded`` (its logical state), ``resumed`` (losses), ``io`` (:func:`io_stats`) and
    ``load_stats`` (every rank's :func:`rank_stats`, or None with DCP's reader). ``corrupt`` flips one
    loaded element on the job's first rank (the recipe's test hook: the oracle must catch it)."""
    cfg = ModelConfig()
    tr = build_trainer(cfg, job, seed=1)  # different init: every value must come from the checkpoint
    sd = tr.state_dict()
    reader = _reader(storage, checkpoint or f"{folder}/ckpt")
    dcp.load(sd, storage_reader=reader, process_group=job.group, planner=UCPLoadPlanner(**trainer_options(cfg, tr)))
    tr.load_state_dict(sd)
    out: dict[str, Any] = {"io": io_stats(reader, job)}
    out["load_stats"] = gather(rank_stats(reader), job.group) if hasattr(reader, "stats") else None
    if corrupt and dist.get_rank(job.group) == 0:
        with torch.no_grad():
            p = next(p for p in tr.chunks[0].parameters() if p.to_local().numel())
            p.to_local().view(-1)[0] += 1.0
    out["loaded"] = logical_state(tr)
    out["resumed"] = [train_step(tr) for _ in range(steps)]
    return out


def elastic_resume(save: Topology, load: Topology, steps: int, folder: str) -> dict | None:
    """Both phases in one process world (every rank calls this; each job on ranks 0..world-1 of its
    topology). Returns, on rank 0, the figures :func:`resume_problems` judges (plus the checkpoint, the
    I/O totals and every load rank's ReadStats); None elsewhere."""
    out: dict = {"save": str(save), "load": str(load)}
    oracle = None
    job = build_job(save, list(range(save.world)))  # every rank builds every job's groups
    if job.member:
        oracle, out["reference"] = save_phase(job, folder, steps)
    dist.barrier()
    job = build_job(load, list(range(load.world)))
    if job.member:
        r = load_phase(job, folder, steps)
        out.update(io=r["io"], load_stats=r["load_stats"], ckpt=f"{folder}/ckpt", resumed=r["resumed"])
        out["state_diffs"] = state_diffs(oracle, r["loaded"]) if oracle is not None else None
        out["entries"] = len(r["loaded"])
    dist.barrier()
    return out if dist.get_rank() == 0 else None


def resume_rels(r: dict, steps: int) -> list[float]:
    """Relative loss differences of the resumed steps against the reference's."""
    return rel_diffs(r["reference"][steps:], r["resumed"])


def resume_problems(r: dict, steps: int) -> list[str]:
    """What makes a RESUME MISMATCH: loaded state not bitwise the oracle's (``state_diffs``, ``entries``);
    losses (``reference``, ``resumed``) not bitwise at the same layout (``save`` == ``load``), or beyond
    the fp32 tolerances at another."""
    problems = state_problem(r["state_diffs"], r["entries"])
    if r["save"] == r["load"]:
        if r["resumed"] != r["reference"][steps:]:
            problems.append("same layout but losses are not bitwise equal")
    else:
        problems += loss_problems(resume_rels(r, steps), steps + 1, 2 * steps)
    return problems


# -- what a load read ---------------------------------------------------------------------------------


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (``all_gather_object`` over ``group``)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def rank_stats(reader: Any) -> dict[str, Any]:
    """What a load's ``UCPFileSystemReader`` counted on this rank (``ReadStats``), in the dry-run plan's terms."""
    s = reader.stats
    return {
        "bytes_read": s.bytes_read,
        "reads": s.ranges,
        "items": sorted(set(s.items)),
        "bytes_received": s.bytes_received,
        "fallbacks": s.fallbacks,
    }


def io_stats(reader: Any, job: Job) -> dict | None:
    """Storage traffic of a load over the job's ranks (``UCPFileSystemReader`` only; collective over the
    job): bytes read and received, saved items, and those read by several ranks or on several hosts
    (``$UCP_DCP_HOST`` names a rank's simulated host)."""
    stats = getattr(reader, "stats", None)
    host = os.environ.get("UCP_DCP_HOST") or socket.gethostname()
    mine = (stats.bytes_read, stats.bytes_received, sorted(set(stats.items)), host) if stats is not None else None
    everyone = gather(mine, job.group)
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
