"""Checks over all ranks' plans: replica agreement, reductions, rule usage and index ownership, and
the coverage of the global save plan.

Each rank puts small summaries in its plan (they travel even when the plan itself is cached), and
the coordinator decides before anything is written or read.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import root_mesh
from ..errors import AmbiguousLayoutError, CoverageError, PatternError, ReplicaMismatchError
from ..layout.index_maps import check_ownership
from ..layout.patterns import Patterns, describe
from ..layout.placements import mesh_info
from ..layout.structure import collision_hint, likely_map
from .digests import value_digest
from .entries import is_sharded
from .payloads import ItemKind, LocalPlanPayload, PlanStructure, ReplicaKey, RuleUsage

if TYPE_CHECKING:
    from .resolve import Resolved

__all__ = [
    "ReplicaGroup",
    "replica_digests",
    "tie_mismatches",
    "check_replica_digests",
    "check_digests",
    "reduce_all",
    "reduce_values",
    "zero_like",
    "check_rule_usage",
    "check_coverage",
    "check_padding",
]

logger = logging.getLogger(__name__)

# -- replica agreement -----------------------------------------------------------------------------


def replica_digests(
    resolved: Sequence[Resolved], mode: str, deferred: list[tuple[str, Any]] | None = None
) -> dict[ReplicaKey, int]:
    """This rank's digests of values that other copies must match: plain tensors and objects saved
    under a shared name (only in a multi-rank save, or for tied copies, and not with ``mode="off"``)
    and the pieces of tied, ``Replicated`` or replicated DTensors. With ``deferred`` (a list), the
    replicated DTensor pieces are not hashed here but listed there as ``(atom, box)``: the storage
    writer compares their copies after the write, from the block checksums it computes anyway."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    out: dict[ReplicaKey, int] = {}

    def whole(r: Resolved, tied: bool = False) -> None:
        if mode == "off" or not (multi or tied):  # tied copies may share one rank
            return
        d = value_digest(r.value)
        if d is not None:
            for name in r.atoms:
                out[(name, None)] = d

    for r in resolved:
        if r.reduce is not None or r.entry.stock:  # stock copies: DCP keeps one rank's, so do we
            continue
        checked = r.replicated is None or r.replicated.check in ("error", "warn")
        if not isinstance(r.value, torch.Tensor):
            whole(r)
        elif not is_sharded(r.value):  # a DTensor's or ShardedTensor's pieces differ by design
            if checked:
                whole(r, bool(r.tied))
        elif r.tied or (checked and mode != "off" and (r.replicated is not None or replicated_pieces(r.value))):
            if deferred is not None and not r.tied and (r.replicated is None or r.replicated.check == "error"):
                deferred.extend((f.atom, f.box) for f in r.fragments)
                continue
            for f in r.fragments:
                out[(f.atom, f.box)] = value_digest(f.view(r.local))
    return out


def replicated_pieces(value: Any) -> bool:
    """Whether other ranks may hold the same pieces of this DTensor, which must then agree: a
    ``Replicate`` placement over a mesh dim of more than one rank (HSDP replicas, TP-replicated
    norms), or a mesh whose sibling slices hold copies (each data-parallel rank's TP mesh), or a
    mesh of only some of the ranks that was not sliced from a larger one (nothing tells its copies
    apart: comparing them is the only check)."""
    if not isinstance(value, DTensor):
        return False
    mesh = value.device_mesh
    if any(p.is_replicate() and n > 1 for p, n in zip(value.placements, mesh.shape)):
        return True
    info = mesh_info(value)
    if info.replica_siblings:
        return True
    return (
        not info.position
        and root_mesh(mesh) is mesh
        and dist.is_initialized()
        and len(info.ranks) < dist.get_world_size()
    )


def tie_mismatches(ties: Sequence[tuple[Resolved, Resolved]]) -> list[str]:
    """Atoms of tied copies on this rank that differ (``(kept, duplicate)`` pairs)."""
    bad = []
    for kept, dup in ties:
        if isinstance(kept.value, torch.Tensor):
            same = {(f.atom, f.box): value_digest(f.view(kept.local)) for f in kept.fragments} == {
                (f.atom, f.box): value_digest(f.view(dup.local)) for f in dup.fragments
            }
        else:
            same = value_digest(kept.value) == value_digest(dup.value)
        if not same:
            bad.append(kept.name)
    return bad


@dataclass
class ReplicaGroup:
    """Ranks that sent identical digests."""

    ranks: list[int] = field(default_factory=list)
    """The ranks of the group."""
    digests: dict[ReplicaKey, int] = field(default_factory=dict)
    """Their digests."""
    tie_mismatches: list[str] = field(default_factory=list)
    """Atoms whose copies on one of these ranks already disagreed."""


def check_replica_digests(
    payloads: Sequence[LocalPlanPayload],
    structures: Mapping[bytes, PlanStructure],
    mode: str,
    atom_meshes: Mapping[str, Sequence[Any]] | None = None,
) -> None:
    """Replica agreement over all ranks, comparing each distinct set of digests once."""
    groups: dict[tuple, ReplicaGroup] = {}
    for rank, p in enumerate(payloads):
        key = (p.packed.structure_hash, p.digests, tuple(p.tie_mismatches))
        if key not in groups:
            digests = np.frombuffer(zlib.decompress(p.digests), dtype=np.uint64).tolist()
            keys = structures[p.packed.structure_hash].replica_keys
            groups[key] = ReplicaGroup([], dict(zip(keys, digests)), list(p.tie_mismatches))
        groups[key].ranks.append(rank)
    warn = {a for p in payloads for a in p.warn_atoms}
    check_digests(list(groups.values()), mode, warn_atoms=warn, atom_meshes=atom_meshes)


def _label(key: ReplicaKey) -> str:
    atom, box = key
    return atom if box is None else f"{atom}@{list(box.offsets)}/{list(box.sizes)}"


def check_digests(
    groups: Sequence[ReplicaGroup],
    mode: str,
    warn_atoms: set[str] | None = None,
    atom_meshes: Mapping[str, Sequence[Any]] | None = None,
) -> None:
    """Refuse (``mode="error"``) or log (``"warn"``) values saved under one key whose digests
    differ between ranks. Atoms in ``warn_atoms`` only warn whatever the mode. Copies that came from
    meshes of different ranks (``atom_meshes``: atom -> mesh keys) are reported as names local to
    a stage or expert rank."""
    if mode == "off":
        return
    # key -> digest -> the rank lists holding it (lists of whole groups: flattened only for a report)
    seen: dict[ReplicaKey, dict[int, list[list[int]]]] = defaultdict(lambda: defaultdict(list))
    for g in groups:
        for key, d in g.digests.items():
            seen[key][d].append(g.ranks)
        for atom in g.tie_mismatches:
            for rank in g.ranks:
                seen[(atom, None)][-rank - 1].append([rank])  # two local copies already disagreed on this rank
    bad = {_label(k): (k[0], v) for k, v in seen.items() if len(v) > 1}
    if not bad:
        return
    hard = [label for label, (atom, _) in bad.items() if not (warn_atoms and atom in warn_atoms)]
    lines = []
    for label, (_, by_digest) in sorted(bad.items())[:10]:
        groups_txt = "; ".join(f"ranks {sorted({r for ranks in lists for r in ranks})}" for lists in by_digest.values())
        lines.append(f"  {label}: {len(by_digest)} different values ({groups_txt})")
    more = f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else ""
    first = bad[min(hard or bad)][0]
    meshes = sorted(set((atom_meshes or {}).get(first, ())))
    if len({ranks for ranks, _ in meshes}) > 1 and first not in (warn_atoms or ()) and mode == "error":
        raise AmbiguousLayoutError(
            f"{len(bad)} value(s) that must be identical across copies differ, and '{first}' comes from "
            f"DTensors on meshes of different ranks ({' and '.join(str(list(r)) for r, _ in meshes)}): they are "
            "not replicas of one tensor:\n" + "\n".join(lines) + more,
            atom=first,
            saved=[list(r) for r, _ in meshes],
            hint=collision_hint(likely_map(first, meshes)),
        )
    err = ReplicaMismatchError(
        f"{len(bad)} value(s) that must be identical across copies differ; DCP would keep one copy and "
        "silently drop the others:\n" + "\n".join(lines) + more,
        atom=bad[min(hard or bad)][0],
        hint="per-rank RNG states and data positions: save them as ucp_dcp.RNGState() and ucp_dcp.GlobalSampler, "
        "which load at any world size (docs/guide.md#9-save-the-rest-of-the-train-state); per-rank counters: declare "
        "a Reduce rule; per-rank tensors: make them DTensors, or declare Replicated(check='average'); or pass "
        "check_replicas='warn' to save anyway",
    )
    if mode == "warn" or not hard:
        logger.warning("%s", err)
        return
    raise err


# -- rules that would drop data -------------------------------------------------------------------


def check_padding(r: Resolved) -> None:
    """A ``Padded`` rule drops the rows beyond the logical size: refuse when they hold anything but
    the fill value (a wrong size would drop real data), unless the rule says ``discard=True``."""
    rule = r.padding_rule
    if rule is None or rule.discard or not r.fills or not isinstance(r.local, torch.Tensor):
        return
    for box in r.fills:
        region = r.local
        for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
            region = region.narrow(d, o, n)
        bad = region != r.fill_value
        if bool(bad.any()):
            raise PatternError(
                f"rule {describe(rule)} drops rows {rule.size}.. of dim {rule.dim} of '{r.name}' as padding, but "
                f"{int(bad.sum())} of their {region.numel()} values here are not the fill value {r.fill_value}: "
                "a save would lose them",
                atom=r.name,
                saved=f"logical size {rule.size}",
                wanted=f"live size {tuple(r.value.shape)}",
                hint="check the rule's size (the logical, unpadded length); if the padding is trained or holds "
                "garbage you do not need, declare Padded(..., discard=True)",
            )


# -- reductions ------------------------------------------------------------------------------------


def reduce_all(patterns: Patterns, payloads: Sequence[LocalPlanPayload]) -> dict[str, Any]:
    """Values of ``Reduce`` atoms: copies within a data slot must agree and count once."""
    values: dict[str, dict[Any, list[Any]]] = {}
    for rank, p in enumerate(payloads):
        for name, v in p.reduced.items():
            slot = ("rank", rank) if p.data_slot is None else p.data_slot
            values.setdefault(name, {}).setdefault(slot, []).append(v)
    out = {}
    for name, by_slot in values.items():
        rule = patterns.reduce(name)
        if rule is None:
            raise PatternError(f"atom '{name}' is reduced on some ranks but no rule matches it here", atom=name)
        per_slot = [reduce_values("equal", copies, name) for _, copies in sorted(by_slot.items(), key=str)]
        out[name] = reduce_values(rule.op, per_slot, name)
    return out


def reduce_values(op: str, values: list[Any], atom: str) -> Any:
    """Combine per-rank values of a :class:`~ucp_dcp.layout.patterns.Reduce` atom."""
    if op == "equal":
        first = values[0]
        for v in values[1:]:
            same = torch.equal(v, first) if isinstance(v, torch.Tensor) else v == first
            if not same:
                raise ReplicaMismatchError(
                    f"atom '{atom}' is declared equal across ranks but holds {first!r} and {v!r}",
                    atom=atom,
                    saved=first,
                    wanted=v,
                    hint="declare a sum/mean/max reduction instead",
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
    raise PatternError(
        f"a Reduce(op='sum') value of type {type(value).__name__} has no zero for the ranks that do not take the total",
        saved=type(value).__name__,
        hint="declare Reduce(op='sum') only for tensors and numbers",
    )


# -- rule usage and index ownership ----------------------------------------------------------------


def check_rule_usage(
    patterns: Patterns,
    usages: Sequence[RuleUsage],
    maps: dict[str, int | None],
    where: str,
    extra_used: set[int] = frozenset(),
) -> None:
    """Strict rule usage on the union of all ranks, and index-map ownership (no unowned layers or
    experts, no index claimed by two owners)."""
    used = set(extra_used)
    for u in usages:
        used.update(u.used)
    patterns.check_used(used, where)
    claims: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    totals = dict(maps)
    for u in usages:
        for key, g, owner in u.claims:
            claims[key].append((g, owner))
        for key, total in u.map_totals.items():
            totals.setdefault(key, total)
            if totals[key] is None:
                totals[key] = total
    for key, total in totals.items():
        check_ownership(key, total, claims.get(key, []), where)


# -- coverage of the global save plan --------------------------------------------------------------


def check_coverage(
    names: list[str],
    shape_of: list[tuple[int, ...] | None],
    atom: np.ndarray,
    off: np.ndarray,
    size: np.ndarray,
    kind: np.ndarray,
    vol: np.ndarray,
) -> None:
    """Every tensor atom's written chunks (one row each) lie inside it and add up to its volume."""
    if not len(atom):
        return
    tensor = kind != ItemKind.BYTES
    expect = np.array([int(np.prod(s)) if s is not None else 0 for s in shape_of], dtype=np.int64)
    got = np.bincount(atom[tensor], weights=vol[tensor], minlength=len(names)).astype(np.int64)
    has = np.bincount(atom[tensor], minlength=len(names)) > 0
    bad = np.nonzero(has & (got != expect) & (expect > 0))[0]
    if len(bad):
        a = int(bad[0])
        raise CoverageError(
            f"saved chunks of '{names[a]}' (shape {shape_of[a]}) cover {got[a]} elements, not {expect[a]} "
            f"({len(bad)} atom(s) affected)",
            atom=names[a],
            saved=int(got[a]),
            wanted=int(expect[a]),
            hint="ranks describe this atom with inconsistent layouts (or a pattern rule describes it wrongly)",
        )
    dims = off.shape[1]
    lim = np.array([list(s) + [0] * (dims - len(s)) if s is not None else [0] * dims for s in shape_of], dtype=np.int64)
    rows = lim[atom]
    valid = off >= 0
    outside = valid & ((off + size > rows) | (size < 0))
    if outside[tensor].any():
        r = int(np.nonzero(outside.any(axis=1) & tensor)[0][0])
        raise CoverageError(
            f"a saved chunk of '{names[atom[r]]}' lies outside its shape {shape_of[atom[r]]}",
            atom=names[atom[r]],
            saved=shape_of[atom[r]],
            wanted=(off[r].tolist(), size[r].tolist()),
        )
