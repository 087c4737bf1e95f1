"""A plan next to the real load it predicts: per-rank storage figures and errors of a load on the pool,
and the comparison with ``ucp_dcp.tools.dryrun.plan_load`` for the same checkpoint and target layout."""

from __future__ import annotations

from typing import Any

import dist as D  # tests/support/dist.py, the pool (`dist` here is torch.distributed)
import torch.distributed as dist

from ucp_dcp.tools.dryrun import plan_load
from ucp_dev.testing.elastic import gather, rank_stats
from ucp_dev.toy import ModelConfig, Topology
from ucp_dev.toy.plan_target import RecipeTarget

RANKS_PER_HOST = 2
"""The pool's transition workers simulate hosts of two ranks (``UCP_DCP_HOST=node{rank // 2}``)."""


def load_failures(exc: BaseException) -> dict[int, str]:
    """Per-rank error texts of a failed ``dcp.load`` (DCP's ``CheckpointException.failures``)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return {-1: f"{type(exc).__name__}: {exc}"}
    out = {}
    for rank, item in failures.items():
        inner = item[0] if isinstance(item, tuple) else item
        out[int(rank)] = f"{type(inner).__name__}: {inner}"
    return out


def compare(report: Any, real: list[dict[str, Any]]) -> list[str]:
    """Differences between a plan's per-rank figures and a real load's (empty: exact)."""
    diffs = []
    if not report.loads:
        return [f"plan says the load fails: {[p.message.splitlines()[0] for p in report.problems]}"]
    if len(report.ranks) != len(real):
        return [f"plan has {len(report.ranks)} ranks, the load {len(real)}"]
    for plan, got in zip(report.ranks, real):
        mine = {
            "bytes_read": plan.bytes_read,
            "reads": plan.reads,
            "items": plan.items,
            "bytes_received": plan.bytes_received,
            "fallbacks": plan.fallbacks,
        }
        for k, v in mine.items():
            if got[k] != v:
                diffs.append(f"rank {plan.rank}: {k} planned {v}, loaded {got[k]}")
    return diffs


def compare_errors(report: Any, real: dict[int, str]) -> list[str]:
    """A failed load's per-rank errors against the plan's problems (the same error on the same ranks)."""
    planned: dict[int, str] = {}
    for p in report.problems:
        for r in p.ranks:
            planned[r] = f"{p.error}: {p.message}"
    diffs = []
    for r in sorted(set(planned) | set(real)):
        if planned.get(r) != real.get(r):
            diffs.append(f"rank {r}: planned {planned.get(r)!r}\n  loaded {real.get(r)!r}")
    return diffs


# -- a save and a load on the pool, and the plan of that load ---------------------------------------------


def _save_load_worker(rank, world, folder, save, load, load_cfg):
    """Save the toy model at ``save`` (ranks 0..), load it at ``load`` with the real reader; rank 0
    returns every load rank's ReadStats (or, for a failed load, every rank's error)."""
    import torch.distributed.checkpoint as dcp

    import ucp_dcp
    from ucp_dev.toy import build_job, build_trainer, trainer_options

    D.setenv("UCP_DCP_HOST", f"node{rank // RANKS_PER_HOST}")
    cfg = ModelConfig()
    s, l = Topology.parse(save), Topology.parse(load)
    job = build_job(s, list(range(s.world)))
    if job.member:
        tr = build_trainer(cfg, job, seed=0)
        dcp.save(
            tr.state_dict(),
            storage_writer=ucp_dcp.UCPFileSystemWriter(f"{folder}/ckpt"),
            process_group=job.group,
            planner=ucp_dcp.UCPSavePlanner(**trainer_options(cfg, tr)),
        )
    dist.barrier()
    job = build_job(l, list(range(l.world)))
    out = None
    if job.member:
        tr = build_trainer(load_cfg or cfg, job, seed=1)
        reader = ucp_dcp.UCPFileSystemReader(f"{folder}/ckpt")
        try:
            dcp.load(
                tr.state_dict(),
                storage_reader=reader,
                process_group=job.group,
                planner=ucp_dcp.UCPLoadPlanner(**trainer_options(load_cfg or cfg, tr)),
            )
            out = {"stats": gather(rank_stats(reader), job.group)}
        except BaseException as e:  # DCP's CheckpointException (every rank raises it)
            out = {"errors": load_failures(e)}
    dist.barrier()
    return out


def real_load(save: str, load: str, load_cfg: Any = None) -> tuple[str, dict]:
    """Save at ``save`` and load at ``load`` on the pool: ``(folder, rank 0's answer)``."""
    world = max(Topology.parse(save).world, Topology.parse(load).world)
    folder = D.tmpdir()
    return folder, D.run(_save_load_worker, 4 if world <= 4 else 8, folder, save, load, load_cfg)[0]


def plan(ckpt: str, load: str, cfg: Any = None) -> Any:
    """The plan of loading ``ckpt`` at the recipe layout ``load``, as the pool's loads run it."""
    return plan_load(
        ckpt,
        RecipeTarget(load, cfg=cfg),
        read_once="hosts",
        ranks_per_node=RANKS_PER_HOST,
        device="cpu",
        keep_items=True,
    )
