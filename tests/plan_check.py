"""A plan next to the real load it predicts: per-rank storage figures and errors of a load on the pool,
and the comparison with ``ucp_dcp.plan.plan_load`` for the same checkpoint and target layout."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

RANKS_PER_HOST = 2
"""The pool's transition workers simulate hosts of two ranks (``UCP_DCP_HOST=node{rank // 2}``)."""


def rank_stats(reader: Any) -> dict[str, Any]:
    """What a real load's reader counted on this rank (``ReadStats``), in the plan's terms."""
    s = reader.stats
    return {"bytes_read": s.bytes_read, "reads": s.ranges, "items": sorted(set(s.items)),
            "bytes_received": s.bytes_received, "fallbacks": s.fallbacks}


def gather(value: Any, group: Any = None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


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
        mine = {"bytes_read": plan.bytes_read, "reads": plan.reads, "items": plan.items,
                "bytes_received": plan.bytes_received, "fallbacks": plan.fallbacks}
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
