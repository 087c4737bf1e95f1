"""Stage-local layer numbers and local expert numbers -> global ones.

A pipeline stage that builds its layers as a re-indexed ``ModuleList`` names global layer 4
``layers.0``; an expert-parallel rank that keeps its experts in a list names global expert
``E/ep`` ``experts.0``. An :class:`IndexMap` rewrites such names (weights and optimizer state
alike) so atoms are parallelism-independent. A rank holding several model chunks (interleaved
schedules) namespaces them in its state dict (``{"model": {"c0": ..., "c1": ...}}``); each
:class:`Chunk` names its namespaces, and that namespace segment is dropped from atom names.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import PatternError
from .naming import Path
from .patterns import integer, refuse, strings, text

__all__ = ["Chunk", "IndexMap", "stage_map", "expert_map", "check_ownership", "map_position"]


@dataclass(frozen=True)
class Chunk:
    """The local->global numbering of one model chunk on this rank."""

    indices: tuple[int, ...] | int
    """Global index of each local index, in local order; an int is an offset (global = offset + local)."""
    prefixes: tuple[str, ...] = ()
    """Dotted path prefixes of this chunk's namespaces (e.g. ``"model.c1"``, ``"optim.c1"``); their
    last segment is removed from names. Empty: the chunk is the whole state dict."""
    owner: int | None = None
    """Id of the pipeline stage (or expert shard) owning the chunk: a global index claimed by two
    different owners is an error at save."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", _indices("Chunk", "indices", self.indices))
        object.__setattr__(self, "prefixes", _prefixes("Chunk", "prefixes", self.prefixes))
        object.__setattr__(self, "owner", _owner("Chunk", "owner", self.owner))

    def global_index(self, local: int, key: str) -> int:
        if isinstance(self.indices, int):
            return self.indices + local
        if not 0 <= local < len(self.indices):
            raise PatternError(
                f"local {key}.{local} has no entry in the map's table {list(self.indices)}",
                hint=f"list the global index of every local {key} entry",
            )
        return self.indices[local]


@dataclass(frozen=True)
class IndexMap:
    """Renumbers ``<key>.<local>`` in names (``key`` = ``"layers"`` or ``"experts"``)."""

    key: str
    """Name of the ModuleList/ModuleDict whose entries are renumbered."""
    chunks: tuple[Chunk, ...]
    """One per model chunk on this rank."""
    total: int | None = None
    """Number of global indices (layers/experts); if set, every one must be owned by some rank."""

    def __post_init__(self) -> None:
        key = text("IndexMap", "key", self.key, _KEY)
        if "." in key:
            raise refuse("IndexMap", "key", key, _KEY)
        what = f"IndexMap({key!r})"
        if isinstance(self.chunks, Chunk) or not isinstance(self.chunks, Iterable):
            raise refuse(what, "chunks", self.chunks, "a sequence of one or more Chunk", hint="wrap it: (chunk,)")
        chunks = tuple(self.chunks)
        if not chunks or not all(isinstance(c, Chunk) for c in chunks):
            raise refuse(what, "chunks", chunks, "a sequence of one or more Chunk")
        object.__setattr__(self, "chunks", chunks)
        if self.total is not None:
            total = integer(what, "total", self.total, 1, "an int >= 1 (the number of global entries) or None")
            object.__setattr__(self, "total", total)
            for c in chunks:
                if not isinstance(c.indices, int):
                    _indices(f"{what}: a chunk", "indices", c.indices, total)
        if sum(1 for c in chunks if not c.prefixes) > 1:
            raise refuse(
                what,
                "chunks",
                chunks,
                "at most one chunk without namespaces (prefixes)",
                hint="several chunks without namespaces are ambiguous: give each chunk its prefixes",
            )

    def __hash__(self) -> int:
        # the fields' hash, made once (:func:`_rewrite` hashes the map on every call)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.key, self.chunks, self.total))
            object.__setattr__(self, "_hash", h)
        return h

    def _chunk(self, path: Path) -> tuple[Chunk, int] | None:
        best: tuple[Chunk, int] | None = None
        for c in self.chunks:
            if not c.prefixes:
                if best is None:
                    best = (c, 0)
                continue
            for p in c.prefixes:
                segs = tuple(p.split("."))
                if tuple(map(str, path[: len(segs)])) == segs and (best is None or len(segs) > best[1]):
                    best = (c, len(segs))
        return best

    def rewrite(self, path: Path) -> tuple[Path, int | None]:
        """``path`` with its chunk namespace dropped and ``<key>.<i>`` renumbered, plus the global index."""
        return _rewrite(self, tuple(path))

    def _rewrite(self, path: Path) -> tuple[Path, int | None]:
        hit = self._chunk(path)
        if hit is None:
            return path, None
        chunk, plen = hit
        if plen:
            path = path[: plen - 1] + path[plen:]
        out = list(path)
        for i, e in enumerate(out):
            if not isinstance(e, str):
                continue
            segs = e.split(".")
            for j, s in enumerate(segs):
                if s != self.key:
                    continue
                if j + 1 < len(segs) and segs[j + 1].isdigit():
                    g = chunk.global_index(int(segs[j + 1]), self.key)
                    segs[j + 1] = str(g)
                    out[i] = ".".join(segs)
                    return tuple(out), g
                if j + 1 == len(segs) and i + 1 < len(out) and str(out[i + 1]).isdigit():
                    g = chunk.global_index(int(out[i + 1]), self.key)
                    out[i + 1] = str(g)
                    return tuple(out), g
        return tuple(out), None

    def owner_of(self, path: Path) -> int | None:
        hit = self._chunk(path)
        return hit[0].owner if hit else None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "total": self.total}


@functools.lru_cache(maxsize=1 << 16)
def _rewrite(m: IndexMap, path: Path) -> tuple[Path, int | None]:
    """:meth:`IndexMap.rewrite`, remembered: a pure function of the map and the path (a frozen, hashable
    map), asked again for every key of every rank ``plan`` simulates with the same map."""
    return m._rewrite(path)


def stage_map(
    layers: Sequence[int] | int, *, total: int | None = None, stage: int | None = None, prefixes: Sequence[str] = ()
) -> IndexMap:
    """One pipeline chunk: ``layers`` is the global index of each local layer (or the first one)."""
    what = "stage_map"
    chunk = Chunk(
        _indices(what, "layers", layers, total), _prefixes(what, "prefixes", prefixes), _owner(what, "stage", stage)
    )
    return IndexMap("layers", (chunk,), total)


def expert_map(experts: Sequence[int] | int, *, total: int | None = None, owner: int | None = None) -> IndexMap:
    """Local expert lists: ``experts`` is the global index of each local expert (or the first one)."""
    what = "expert_map"
    return IndexMap(
        "experts", (Chunk(_indices(what, "experts", experts, total), (), _owner(what, "owner", owner)),), total
    )


_INDICES = "an int >= 0 (the global index of local entry 0) or a sequence of distinct ints >= 0 (one per local entry)"
_PREFIXES = "a sequence of dotted state-dict paths (non-empty strings, no empty segment)"
_KEY = "the name of a ModuleList/ModuleDict (a non-empty string without dots, e.g. 'layers')"


def _indices(what: str, arg: str, value: Any, total: Any = None) -> int | tuple[int, ...]:
    """A chunk's local -> global table, checked: an offset, or distinct global indices (below ``total``
    when it is an int: a wrong ``total`` is the map's to report)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return integer(what, arg, value, 0, _INDICES)
    table = tuple(integer(what, arg, i, 0, _INDICES) for i in value)
    if len(set(table)) < len(table):
        raise refuse(what, arg, value, _INDICES, hint="two local entries cannot be one global entry")
    if isinstance(total, int) and not isinstance(total, bool) and any(i >= total for i in table):
        raise refuse(what, arg, value, f"global indices below total={total}", hint="check the table and the total")
    return table


def _prefixes(what: str, arg: str, value: Any) -> tuple[str, ...]:
    prefixes = strings(what, arg, value, _PREFIXES)
    if any("" in p.split(".") for p in prefixes):
        raise refuse(what, arg, value, _PREFIXES)
    return prefixes


def _owner(what: str, arg: str, value: Any) -> int | None:
    return None if value is None else integer(what, arg, value, 0, "an int >= 0 (a stage or shard id) or None")


def map_position(name: str, key: str) -> tuple[str, int] | None:
    """Where a dotted atom name numbers an entry of the map ``key``: ``(template, index)`` with the
    first ``<key>.<i>`` written ``<key>.*`` in the template (``model.layers.2.w`` -> ``("model.layers.*.w",
    2)``); None when the name numbers no such entry."""
    segs = name.split(".")
    for j in range(len(segs) - 1):
        if segs[j] == key and segs[j + 1].isdigit():
            return ".".join(segs[: j + 1] + ["*"] + segs[j + 2 :]), int(segs[j + 1])
    return None


def check_ownership(key: str, total: int | None, claims: Iterable[tuple[int, int | None]], where: str) -> None:
    """Every global index in ``range(total)`` must be claimed, and never by two different owners.
    ``claims`` are ``(global index, owner id or None)`` pairs gathered from all ranks."""
    owners: dict[int, set[int]] = {}
    seen: set[int] = set()
    for g, owner in claims:
        seen.add(g)
        if owner is not None:
            owners.setdefault(g, set()).add(owner)
    clash = {g: sorted(o) for g, o in owners.items() if len(o) > 1}
    if clash:
        g, o = min(clash.items())
        raise PatternError(
            f"{key} {g} is claimed by owners {o} {where} ({len(clash)} such {key})",
            atom=f"{key}.{g}",
            hint=f"each global {key} entry must belong to exactly one stage/shard; check the map's tables",
        )
    if total is not None:
        bad = sorted(g for g in seen if not 0 <= g < total)
        missing = sorted(set(range(total)) - seen)
        if bad:
            raise PatternError(f"{key} indices {bad[:10]} are outside 0..{total - 1} {where}", atom=f"{key}.{bad[0]}")
        if missing:
            raise PatternError(
                f"{len(missing)} of {total} {key} are owned by no rank {where}: {missing[:20]}",
                atom=f"{key}.{missing[0]}",
                saved=total,
                wanted=sorted(seen)[:20],
                hint=f"the stage/expert map leaves {key} unowned: fix the per-rank tables",
            )
