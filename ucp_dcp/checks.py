"""Coordinator-side checks over all ranks' plans: replica agreement, reductions, rule usage and
index ownership. Each rank puts small summaries in its plan's ``planner_data`` (they travel even
when the plan itself is cached), and the coordinator decides before anything is written or read."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from .errors import ReplicaMismatchError
from .patterns import Patterns
from .index_maps import check_ownership

__all__ = ["check_digests", "reduce_values", "check_rules_and_ownership", "zero_like"]

logger = logging.getLogger(__name__)


def check_digests(groups: Sequence[dict[str, Any]], mode: str, warn_keys: set[str] | None = None) -> None:
    """Refuse (``mode="error"``) or log (``"warn"``) values saved under one key whose digests
    differ between ranks. ``groups`` gather ranks with identical digests: ``{"ranks": [...],
    "digests": {key: digest}, "local_mismatch": [keys whose copies on one rank disagreed]}``.
    Keys in ``warn_keys`` only warn whatever the mode."""
    if mode == "off":
        return
    seen: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for g in groups:
        for key, d in g["digests"].items():
            seen[key][d].extend(g["ranks"])
        for key in g.get("local_mismatch") or ():
            for rank in g["ranks"]:
                seen[key][-rank - 1].append(rank)  # two local copies already disagreed on this rank
    bad = {k: v for k, v in seen.items() if len(v) > 1}
    if not bad:
        return
    hard = {k: v for k, v in bad.items() if not (warn_keys and k.split("@")[0] in warn_keys)}
    lines = []
    for key, by_digest in sorted(bad.items())[:10]:
        groups_txt = "; ".join(f"ranks {sorted(set(r))}" for r in by_digest.values())
        lines.append(f"  {key}: {len(by_digest)} different values ({groups_txt})")
    more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
    first = sorted(hard or bad)[0].split("@")[0]
    err = ReplicaMismatchError(
        f"{len(bad)} value(s) that must be identical across copies differ; DCP would keep one copy and "
        "silently drop the others:\n" + "\n".join(lines) + more,
        atom=first,
        hint="give per-rank values distinct names, make them DTensors, declare a Reduce rule for per-rank "
        "counters or Replicated(check='average'), or pass check_replicas='warn' to save anyway",
    )
    if mode == "warn" or not hard:
        logger.warning("%s", err)
        return
    raise err


def reduce_values(op: str, values: list[Any], atom: str) -> Any:
    """Combine per-rank values of a :class:`~ucp_dcp.patterns.Reduce` atom."""
    if op == "equal":
        first = values[0]
        for v in values[1:]:
            same = torch.equal(v, first) if isinstance(v, torch.Tensor) else v == first
            if not same:
                raise ReplicaMismatchError(
                    f"atom '{atom}' is declared equal across ranks but holds {first!r} and {v!r}",
                    atom=atom, saved=first, wanted=v, hint="declare a sum/mean/max reduction instead",
                )
        return first
    if isinstance(values[0], torch.Tensor):
        stacked = torch.stack([v.to(values[0].dtype) for v in values])
        if op == "sum":
            return stacked.sum(0)
        if op == "max":
            return stacked.max(0).values
        return (stacked.double().mean(0)).to(values[0].dtype)
    if op == "sum":
        return sum(values)
    if op == "max":
        return max(values)
    return sum(values) / len(values)


def zero_like(value: Any) -> Any:
    """The additive zero of a reduced value's type (non-coordinator ranks after a ``sum`` load)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float, complex)):
        return type(value)(0)
    raise TypeError(f"cannot zero a {type(value).__name__}")


def check_rules_and_ownership(
    patterns: Patterns,
    planner_datas: Sequence[dict[str, Any]],
    maps: dict[str, int | None],
    where: str,
    extra_used: set[int] = frozenset(),
) -> None:
    """Strict rule usage on the union of all ranks, and index-map ownership (no unowned layers or
    experts, no index claimed by two owners)."""
    used = set(extra_used)
    for pd in planner_datas:
        used.update(pd.get("used") or ())
    patterns.check_used(used, where)
    claims: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    totals = dict(maps)
    for pd in planner_datas:
        for key, g, owner in pd.get("claims") or ():
            claims[key].append((g, owner))
        for key, total in (pd.get("map_totals") or {}).items():
            totals.setdefault(key, total)
            if totals[key] is None:
                totals[key] = total
    for key, total in totals.items():
        check_ownership(key, total, claims.get(key, []), where)
