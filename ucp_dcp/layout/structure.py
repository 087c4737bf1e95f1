"""Structural facts the state itself holds, checked instead of trusting declarations.

A DTensor is a whole logical tensor over its mesh. Two DTensors that produce one atom from meshes
sliced at *different pipeline or expert coordinates* of one root mesh (stage 0's and stage 1's FSDP
meshes) are two whole tensors, not pieces of one: unless the atom is declared ``Tied`` (its copies
are then compared), they are stage-local or expert-local names that collided because a
``stage_map``/``expert_map`` is missing. Without this check, dedup would keep one copy per box, and
could even stitch one atom from both stages' pieces. Meshes of different ranks that are *not* told
apart by such a coordinate (each data-parallel rank's TP mesh in a TP-only job, or meshes built
without a root) may hold replicas: their pieces are compared by digest at save instead
(:mod:`ucp_dcp.planning.consistency`), and a mismatch there is reported with the same hint.

The same fact is checked at save (over the ranks' catalog records) and at load (over the ranks'
target meshes), so a map forgotten on either side is refused before a byte is written or read.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch.distributed.tensor import DTensor

from ..errors import AmbiguousLayoutError
from .placements import mesh_info

__all__ = [
    "MeshKey",
    "mesh_collisions",
    "check_mesh_collisions",
    "likely_map",
    "catalog_meshes",
    "tied_atoms",
    "target_meshes",
    "unpack_meshes",
    "collision_hint",
    "map_orders",
    "check_map_orders",
]

MeshKey = tuple[tuple[int, ...], tuple[tuple[str, int], ...]]
"""A mesh as the checks see it: its sorted ranks and its position along pipeline/expert dims."""

_INDEXED = re.compile(r"(?:^|\.)(layers|experts)\.(\d+)(?:\.|$)")


def likely_map(atom: str, meshes: Iterable[MeshKey] = ()) -> str:
    """Which index map a colliding name most likely lacks."""
    dims = {name for _, pos in meshes for name, _ in pos}
    keys = [m.group(1) for m in _INDEXED.finditer(atom)]
    if "experts" in keys or (dims and all(set(d.lower().split("_")) & {"ep", "expert", "experts"} for d in dims)):
        return "expert_map"
    if "layers" in keys or dims:
        return "stage_map"
    return "stage_map/expert_map"


def collision_hint(fix: str) -> str:
    return (
        f"the names are local to each pipeline stage or expert-parallel rank: pass a {fix} "
        "(ucp_dcp.stage_map / expert_map) on every rank, at save and at load; if the copies really are one "
        "tensor (an embedding tied to the output head), declare Tied"
    )


def mesh_collisions(atom_meshes: Mapping[str, Iterable[MeshKey]], tied: set[str]) -> dict[str, list[MeshKey]]:
    """Atoms (except ``tied`` ones) whose DTensors sit at different pipeline/expert positions."""
    out = {}
    for atom, meshes in atom_meshes.items():
        distinct = sorted(set(meshes))
        positions = {pos for _, pos in distinct if pos}
        if len(positions) > 1 and atom not in tied:
            out[atom] = distinct
    return out


def _where(key: MeshKey) -> str:
    ranks, pos = key
    at = ", ".join(f"{n}={c}" for n, c in pos)
    return f"{list(ranks)}" + (f" ({at})" if at else "")


def check_mesh_collisions(
    atom_meshes: Mapping[str, Iterable[MeshKey]],
    tied: set[str],
    where: str,
    bad: dict[str, list[MeshKey]] | None = None,
) -> None:
    """Refuse atoms that come from DTensors at different pipeline/expert positions (see the module
    docstring), or the given ``bad`` ones."""
    bad = mesh_collisions(atom_meshes, tied) if bad is None else bad
    if not bad:
        return
    first = min(bad)
    lines = [f"  {a}: ranks " + " and ".join(_where(m) for m in bad[a]) for a in sorted(bad)[:8]]
    more = f"\n  ... and {len(bad) - 8} more" if len(bad) > 8 else ""
    raise AmbiguousLayoutError(
        f"{len(bad)} atom(s) {where} come from DTensors on different meshes, each a whole tensor of its own, "
        f"so they are not replicas of one tensor:\n" + "\n".join(lines) + more,
        atom=first,
        saved=[_where(m) for m in bad[first]],
        hint=collision_hint(likely_map(first, bad[first])),
    )


def catalog_meshes(local_cats: Sequence[dict[str, Any] | None]) -> dict[str, list[MeshKey]]:
    """Per atom, the rank sets of the meshes its DTensor records name, over per-rank catalogs."""
    out: dict[str, list[MeshKey]] = {}
    for cat in local_cats:
        if not cat:
            continue
        meshes = [(tuple(sorted(m["ranks"])), tuple(tuple(p) for p in m.get("position", ()))) for m in cat["meshes"]]
        for name, rec in cat["atoms"].items():
            layout = rec.get("layout")
            if layout is not None:
                out.setdefault(name, []).append(meshes[layout["mesh"]])
    return out


def tied_atoms(patterns: Any, structures: Iterable[Any]) -> set[str]:
    """Atoms of parameters a ``Tied`` rule declares one tensor (their copies may sit on any mesh)."""
    params = {r.param for r in patterns.rules if r.kind == "tied"}
    return {name for st in structures for name, rec in st.catalog["atoms"].items() if rec.get("param") in params}


def target_meshes(resolved: Iterable[Any]) -> dict[MeshKey, bytes]:
    """A loading rank's DTensor target atoms by the rank set of their mesh (names zlib-packed: the
    coordinator compares them with every other rank's). Tied copies may sit on any mesh."""
    per_mesh: dict[int, tuple[Any, list[str]]] = {}  # by mesh record object: a key of ranks is O(mesh) to hash
    for r in resolved:
        if r.present and not r.tied and isinstance(r.value, DTensor):
            info = mesh_info(r.value)
            per_mesh.setdefault(id(info), (info, []))[1].extend(r.atoms)
    by: dict[MeshKey, list[str]] = {}
    for info, names in per_mesh.values():
        by.setdefault(info.key, []).extend(names)
    return {k: zlib.compress("\n".join(sorted(v)).encode(), 1) for k, v in by.items()}


def unpack_meshes(per_rank: Iterable[Mapping[MeshKey, bytes]]) -> dict[str, list[MeshKey]]:
    """Per atom, the rank sets of the meshes the loading ranks want it on."""
    out: dict[str, list[MeshKey]] = {}
    seen: set[tuple[MeshKey, bytes]] = set()
    for meshes in per_rank:
        for ranks, packed in meshes.items():
            if (ranks, packed) in seen:  # every rank of a mesh sends the same list
                continue
            seen.add((ranks, packed))
            for name in zlib.decompress(packed).decode().split("\n") if packed else ():
                if name:
                    out.setdefault(name, []).append(ranks)
    return out


def map_orders(usages: Iterable[Any]) -> dict[str, str]:
    """How each index map numbers its owners' entries, from all ranks' claims ``(key, global index,
    owner)``: ``ascending`` when owners in id order hold ever higher indices (stage 0 the first
    layers, EP rank 0 the first experts), ``descending`` for the reverse, ``other`` otherwise. With
    a single owner nothing is known (left out). Recorded in the catalog at save and compared at load:
    two maps that number in opposite directions put every layer or expert in another's place."""
    lows: dict[str, dict[int, int]] = {}
    for u in usages:
        for key, g, owner in u.claims:
            if owner is not None:
                lows.setdefault(key, {})[owner] = min(g, lows.get(key, {}).get(owner, g))
    out = {}
    for key, by_owner in lows.items():
        seq = [by_owner[o] for o in sorted(by_owner)]
        if len(seq) < 2:
            continue
        up = all(a < b for a, b in zip(seq, seq[1:]))
        down = all(a > b for a, b in zip(seq, seq[1:]))
        out[key] = "ascending" if up else "descending" if down else "other"
    return out


def check_map_orders(saved: Mapping[str, str], now: Mapping[str, str]) -> None:
    """Refuse a load whose index maps number in another direction than the checkpoint's did."""
    for key in sorted(set(saved) & set(now)):
        if saved[key] != now[key] and "other" not in (saved[key], now[key]):
            arg = {"layers": "stage_map", "experts": "expert_map"}.get(key, f"IndexMap({key!r})")
            raise AmbiguousLayoutError(
                f"the checkpoint's {arg} numbered '{key}' in {saved[key]} order of their owners (stage / expert "
                f"rank), this load's {arg} in {now[key]} order: every {key[:-1]} would land in another's place",
                atom=f"{key}.0",
                saved=saved[key],
                wanted=now[key],
                hint=f"build the {arg} the same way at save and at load (global index = owner's first index + "
                "local index, owners in mesh order)",
            )
