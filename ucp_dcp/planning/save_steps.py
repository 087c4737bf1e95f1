"""The save plan: each rank's local plan, the coordinator's global plan and metadata, and the
``WriteItem`` list a rank rebuilds from the coordinator's answer.

The split follows DCP's ``default_planner``: :func:`build_local` is ``create_local_plan``'s work,
:func:`global_plan` is ``create_global_plan``'s, :func:`final_items` is ``finish_plan``'s. Unlike
DCP, plans travel as arrays (:mod:`ucp_dcp.planning.payloads`) and the coordinator works on all ranks' items at
once: dedup of replicated pieces by row keys, volume and bounds checks per atom with ``bincount``.

One module, as DCP's ``default_planner.py`` keeps its three phases together: the local plan, the global plan
and the final items share the row layout of the plan arrays. The two helpers only the save's global plan uses
follow, in the order it calls them: dedup of replicated pieces, and replicas saved as their mean.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import AmbiguousLayoutError, PatternError, UCPError
from ..layout.fragments import Fragment
from ..layout.patterns import Patterns
from ..layout.placements import Layout, dtype_name, global_shape
from ..options import UCPOptions
from . import catalog as cat_mod
from .catalog import Catalog
from .collectives import p2p_group, send_device
from .consistency import check_coverage, check_padding, replica_digests, tie_mismatches
from .entries import is_sharded
from .payloads import (
    ItemKind,
    LocalItems,
    LocalPlanPayload,
    Offsets,
    PackedPlan,
    PieceKey,
    PlanStructure,
    RankAnswer,
    ReducedItem,
    RuleUsage,
    dtype_code,
    dtype_of,
)
from .resolve import Resolved
from .ties import catalog_aliases, check_aliases

__all__ = [
    "GlobalSave",
    "LocalPlan",
    "Rows",
    "average_writers",
    "build_local",
    "choose_writers",
    "exchange_averages",
    "final_items",
    "global_plan",
    "is_averaged",
    "live_entries",
    "local_payload",
    "merge_cached",
    "plan_global",
    "replica_copies_to_verify",
    "structures_by_hash",
    "tensor_item",
    "write_rows",
]

# -- local plan ------------------------------------------------------------------------------------


def live_entries(resolved: list[Resolved]) -> tuple[list[Resolved], list[tuple[Resolved, Resolved]]]:
    """The entries this rank saves, and the tied copies it only compares (``(kept, copy)``). Refuses
    a Partial placement and two live keys producing one atom."""
    owner: dict[str, Resolved] = {}
    kept: list[Resolved] = []
    ties: list[tuple[Resolved, Resolved]] = []
    for r in resolved:
        if not r.present:
            continue
        if isinstance(r.value, DTensor) and (layout := Layout.from_dtensor(r.value)).partial_dims():
            raise AmbiguousLayoutError(
                f"atom '{r.name}' has a Partial placement ({layout.describe()}); its logical value is a pending "
                "reduction, not a tensor",
                atom=r.name,
                saved=layout.describe(),
                hint="redistribute to Replicate/Shard (e.g. `.redistribute(placements=...)`) before saving",
            )
        clash = next((a for a in r.atoms if a in owner), None)
        if clash is not None:
            if r.tied and owner[clash].tied:  # a second copy of a tied parameter on this rank: compare, save once
                ties.append((owner[clash], r))
                continue
            raise AmbiguousLayoutError(
                f"atom '{clash}' is produced by two live keys: '{owner[clash].entry.key}' and '{r.entry.key}'",
                atom=clash,
                hint="the keys differ only by wrapper segments (or two rules map them to one atom); save "
                "one of them, declare them Tied, or pass name_rules that keep the distinguishing segment",
            )
        owner.update((a, r) for a in r.atoms)
        kept.append(r)
    return kept, ties


@dataclass
class LocalPlan:
    """What ``create_local_plan`` computed on this rank."""

    structure: PlanStructure
    """Names, shapes, dtypes, flatten paths, catalog records and digested values."""
    items: LocalItems
    """Write items as arrays."""
    pieces: dict[PieceKey, tuple[Resolved, Fragment | None]]
    """Where each piece's data is, for ``resolve_data``."""
    digests: bytes
    """zlib-compressed uint64 digests, in ``structure.replica_keys`` order."""
    reduced: dict[str, Any]
    """``Reduce`` atom -> this rank's value."""
    deferred: list[tuple[str, Offsets, Offsets]]
    """Replicated pieces whose copies the storage writer compares after the write: ``(atom, offsets, sizes)``."""


class _AtomTable:
    """Atom names in first-use order, with the shape and dtype code of their first use."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...] | None] = []
        self.dtypes: list[int] = []
        self._index: dict[str, int] = {}

    def id(self, name: str, shape: tuple[int, ...] | None, dtype: torch.dtype | None) -> int:
        if name not in self._index:
            self._index[name] = len(self.names)
            self.names.append(name)
            self.shapes.append(shape)
            self.dtypes.append(dtype_code(dtype) if dtype is not None else -1)
        return self._index[name]


def build_local(
    resolved: list[Resolved],
    mappings: dict[str, Any],
    check_replicas: str,
    defer_pieces: bool = False,
    raw_optimizers: dict[str, list[list[int]]] | None = None,
    dropped: set[tuple[str, Offsets | None]] | frozenset = frozenset(),
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> LocalPlan:
    """This rank's items (one per piece of local memory, or per object), reduced values and digests;
    ``raw_optimizers`` (the parameter positions of raw ``optimizer.state_dict()`` values) go to the catalog.
    ``dropped`` pieces (``(atom, offsets)``) get no item and ``dtypes`` replaces atoms' saved dtypes:
    what a ``create_local_plan`` override did to the items (:mod:`ucp_dcp.planning.hooks`)."""
    dtypes = dtypes or {}
    table = _AtomTable()
    rows: list[tuple[int, ItemKind, Offsets, Offsets]] = []
    pieces: dict[PieceKey, tuple[Resolved, Fragment | None]] = {}
    reduced: dict[str, Any] = {}
    for r in resolved:
        tensor = isinstance(r.value, torch.Tensor)
        check_padding(r)
        if r.reduce is not None:  # not written here: the coordinator writes the reduced value
            for name in r.atoms:
                table.id(name, tuple(r.atoms[name]["shape"]) if tensor else None, r.value.dtype if tensor else None)
                reduced[name] = r.value.detach().cpu().clone() if tensor else r.value
            continue
        for name, kind, offsets, sizes, frag in write_rows(r):
            if (name, offsets if tensor else None) in dropped:
                continue
            dtype = dtypes.get(name, r.local.dtype) if tensor else None
            a = table.id(name, tuple(r.atoms[name]["shape"]) if tensor else None, dtype)
            rows.append((a, kind, offsets, sizes))
            pieces[(name, offsets if tensor else None)] = (r, frag)
    deferred: list[tuple[str, Any]] | None = [] if defer_pieces else None
    digests = replica_digests(resolved, check_replicas, deferred)
    structure = PlanStructure(
        table.names,
        table.shapes,
        table.dtypes,
        mappings,
        _local_catalog(resolved, raw_optimizers, dtypes),
        whole_digests=sorted(a for a, box in digests if box is None),
        piece_digests=sorted((a, box.offsets, box.sizes) for a, box in digests if box is not None),
    )
    values = np.array([digests[k] for k in structure.replica_keys], dtype=np.uint64)
    return LocalPlan(
        structure,
        LocalItems.from_rows(rows),
        pieces,
        zlib.compress(values.tobytes(), 1),
        reduced,
        [(a, tuple(box.offsets), tuple(box.sizes)) for a, box in deferred or ()],
    )


def write_rows(r: Resolved) -> list[tuple[str, ItemKind, Offsets, Offsets, Fragment | None]]:
    """One live entry's items: ``(atom, kind, offsets, sizes, fragment)``."""
    if not isinstance(r.value, torch.Tensor):
        return [(name, ItemKind.BYTES, (), (), None) for name in r.atoms]
    frags: list[tuple[str, Fragment | None]] = [(f.atom, f) for f in r.fragments]
    if math.prod(global_shape(r.value)) == 0:  # keep empty atoms visible in the metadata: one empty chunk each
        frags = [(name, None) for name in r.atoms]
    dt = is_sharded(r.value)
    out = []
    for name, f in frags:
        shape = tuple(r.atoms[name]["shape"])
        offsets = tuple(f.box.offsets) if f is not None else (0,) * len(shape)
        sizes = tuple(f.box.sizes) if f is not None else shape
        # DCP allows one TENSOR item per key: pieces (DTensor shards, fused blocks) are SHARDs
        out.append((name, ItemKind.TENSOR if not dt and sizes == shape else ItemKind.SHARD, offsets, sizes, f))
    return out


def _local_catalog(
    resolved: list[Resolved], raw_optimizers: dict[str, list[list[int]]] | None, dtypes: Mapping[str, torch.dtype]
) -> dict[str, Any]:
    """This rank's catalog records, meshes interned (``dtypes``: saved dtypes a hook changed)."""
    cat = cat_mod.local_catalog()
    if raw_optimizers:
        cat["raw_optimizers"] = raw_optimizers
    for r in resolved:
        for name, rec in r.atoms.items():
            rec = dict(rec)
            if name in dtypes and "dtype" in rec:
                rec["dtype"] = dtype_name(dtypes[name])
            if "layout" in rec:
                rec["layout"] = {
                    "mesh": cat_mod.intern(cat["meshes"], rec["layout"]["mesh"]),
                    "placements": rec["layout"]["placements"],
                }
            cat["atoms"][name] = rec
    return cat


def local_payload(
    local: LocalPlan,
    resolved: list[Resolved],
    ties: list[tuple[Resolved, Resolved]],
    patterns: Patterns,
    options: UCPOptions,
    is_coordinator: bool,
) -> LocalPlanPayload:
    """What this rank sends the coordinator."""
    return LocalPlanPayload(
        packed=PackedPlan.pack(local.structure, local.items),
        digests=local.digests,
        tie_mismatches=tie_mismatches(ties),
        reduced=local.reduced,
        data_slot=options.data_slot,
        usage=RuleUsage(
            sorted(patterns.used),
            sorted({c for r in resolved for c in r.index_claims}, key=str),
            {m.key: m.total for m in options.maps},
        ),
        warn_atoms=sorted(
            {a for r in resolved if r.replicated is not None and r.replicated.check == "warn" for a in r.atoms}
        ),
        averaged=sorted({(f.atom, f.box.offsets) for r in resolved if is_averaged(r) for f in r.fragments}),
        coordinator=is_coordinator,
        global_rank=dist.get_rank() if dist.is_initialized() else 0,
        deferred=local.deferred,
    )


# -- global plan -----------------------------------------------------------------------------------


@dataclass
class GlobalSave:
    """The coordinator's plan over all ranks' items."""

    state_dict_metadata: dict[str, Any]
    """DCP metadata of every atom."""
    keep: list[np.ndarray]
    """Per rank: bool mask of its items it writes."""
    structures: list[PlanStructure]
    """Distinct structures, in first-rank order."""
    structure_of: list[int]
    """Per rank: index into ``structures``."""
    items: list[LocalItems]
    """Per rank: its items."""


@dataclass
class _Atoms:
    """Global atom ids over all distinct structures."""

    names: list[str]
    """Atom names, in first-rank order."""
    shapes: list[tuple[int, ...] | None]
    """Global shape per atom: the first one that is not None (None: an object everywhere)."""
    dtypes: np.ndarray
    """dtype code per atom, of the structure that gave its shape."""
    remaps: list[np.ndarray]
    """Per structure: its atom index -> global atom id."""

    @classmethod
    def of(cls, structures: list[PlanStructure]) -> _Atoms:
        gid: dict[str, int] = {}
        shapes: list[tuple[int, ...] | None] = []
        dtypes: list[int] = []
        remaps = []
        for st in structures:
            remap = np.empty(len(st.names), dtype=np.int64)
            for i, n in enumerate(st.names):
                g = remap[i] = gid.setdefault(n, len(gid))
                if g == len(shapes):
                    shapes.append(None)
                    dtypes.append(-1)
                if shapes[g] is None:
                    shapes[g] = tuple(st.shapes[i]) if st.shapes[i] is not None else None
                    dtypes[g] = st.dtypes[i]
            remaps.append(remap)
        return cls(list(gid), shapes, np.array(dtypes, dtype=np.int64), remaps)


def plan_global(plans: Sequence[PackedPlan], lowest_rank: bool) -> GlobalSave:
    """Dedup replicated pieces, pick writers, build and check the metadata (``plans`` per rank)."""
    structures, structure_of = _distinct_structures(plans)
    items = [p.unpack_items() for p in plans]
    atoms = _Atoms.of(structures)
    rows = Rows.concat(items, [atoms.remaps[s] for s in structure_of])
    vol = rows.volume
    itemsize = np.array([dtype_of(c).itemsize if c >= 0 else 1 for c in atoms.dtypes.tolist()] or [1], dtype=np.int64)
    nbytes = np.where(rows.kind == ItemKind.BYTES, 1, vol * itemsize[rows.atom] if len(rows.atom) else 0)
    keep = choose_writers(rows, nbytes, len(plans), lowest_rank)
    check_coverage(
        atoms.names, atoms.shapes, rows.atom[keep], rows.off[keep], rows.size[keep], rows.kind[keep], vol[keep]
    )
    sdm = _metadata(atoms, rows.atom[keep], rows.off[keep], rows.size[keep], rows.kind[keep])
    splits = np.cumsum([len(it.atom) for it in items])[:-1]
    return GlobalSave(sdm, np.split(keep, splits), structures, structure_of, items)


def structures_by_hash(
    plans: Sequence[PackedPlan], known: Mapping[bytes, PlanStructure] | None = None
) -> dict[bytes, PlanStructure]:
    """Each distinct structure by hash (in first-rank order), decoded once unless ``known``."""
    out: dict[bytes, PlanStructure] = {}
    for p in plans:
        h = p.structure_hash
        if h not in out:
            out[h] = known[h] if known is not None and h in known else p.unpack_structure()
    return out


def _distinct_structures(plans: Sequence[PackedPlan]) -> tuple[list[PlanStructure], list[int]]:
    """The distinct structures, and per rank the index of its own."""
    by_hash = structures_by_hash(plans)
    index = {h: i for i, h in enumerate(by_hash)}
    return list(by_hash.values()), [index[p.structure_hash] for p in plans]


def _metadata(atoms: _Atoms, atom: np.ndarray, off: np.ndarray, size: np.ndarray, kind: np.ndarray) -> dict[str, Any]:
    """DCP metadata per atom from the written rows, chunks in rank order."""
    out: dict[str, Any] = {}
    order = np.argsort(atom, kind="stable")
    atom_s, off_s, size_s, kind_s = atom[order], off[order], size[order], kind[order]
    ids = np.arange(len(atoms.names))
    starts, ends = np.searchsorted(atom_s, ids), np.searchsorted(atom_s, ids, side="right")
    for a, name in enumerate(atoms.names):
        lo, hi = int(starts[a]), int(ends[a])
        if lo == hi:
            continue
        if kind_s[lo] == ItemKind.BYTES:
            out[name] = BytesStorageMetadata()
            continue
        nd = len(atoms.shapes[a])
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in zip(off_s[lo:hi, :nd].tolist(), size_s[lo:hi, :nd].tolist())
        ]
        out[name] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_of(int(atoms.dtypes[a]))), torch.Size(atoms.shapes[a]), chunks
        )
    return out


def global_plan(
    payloads: Sequence[LocalPlanPayload],
    reduced: dict[str, Any],
    lowest_rank: bool,
    writer: dict[str, str],
    rules_json: list[dict[str, Any]],
    map_keys: list[str],
    map_orders: dict[str, str] | None = None,
) -> tuple[list[RankAnswer], Metadata]:
    """Every rank's answer (a keep mask, reduced items for the coordinator, averaging duties) and
    the metadata (flatten mappings and the catalog in ``planner_data``)."""
    result = plan_global([p.packed for p in payloads], lowest_rank)
    sdm = result.state_dict_metadata
    reduced_items = []
    for name, value in sorted(reduced.items()):
        if isinstance(value, torch.Tensor):
            sdm[name] = TensorStorageMetadata(
                TensorProperties(dtype=value.dtype),
                value.shape,
                [ChunkStorageMetadata(torch.Size((0,) * value.ndim), value.shape)],
            )
            reduced_items.append(ReducedItem(name, tuple(value.shape), value.dtype))
        else:
            sdm[name] = BytesStorageMetadata()
            reduced_items.append(ReducedItem(name, None, None))
    mappings: dict[str, Any] = {}
    for st in result.structures:
        mappings.update(st.paths)
    # one catalog per distinct structure: its errors name the ranks holding that structure, not its index
    holders = [[r for r, s in enumerate(result.structure_of) if s == i] for i in range(len(result.structures))]
    merged = cat_mod.merge_local_catalogs(
        [st.catalog for st in result.structures], writer=writer, world_size=len(payloads), ranks=holders
    )
    catalog = dataclasses.replace(
        Catalog.from_json(merged),
        rules=tuple(rules_json),
        maps=tuple(sorted(map_keys)),
        map_orders=dict(sorted((map_orders or {}).items())),
    )
    check_aliases(catalog)
    aliases = catalog_aliases(catalog)
    # an alias's flatten path too: ucp_dcp's writer adds it to the metadata as a key of the same bytes
    planner_data: dict[str, Any] = {k: mappings[k] for k in [*sdm, *aliases] if k in mappings}
    planner_data[cat_mod.CATALOG_KEY] = catalog.to_json(cat_mod.FORMAT)
    coordinator = next((i for i, p in enumerate(payloads) if p.coordinator), 0)
    averages = average_writers(payloads, result.items, result.keep, [result.structures[s] for s in result.structure_of])
    verify = replica_copies_to_verify(
        payloads, [result.structures[i] for i in result.structure_of], result.items, result.keep
    )
    exchange = any(averages.values())  # every rank, so a side group (NCCL-only jobs) is created by all
    answers = [
        RankAnswer.from_mask(
            keep,
            reduced=reduced_items if rank == coordinator else [],
            averages=averages.get(rank, {}),
            exchange=exchange,
            verify=verify.get(rank, []),
        )
        for rank, keep in enumerate(result.keep)
    ]
    return answers, Metadata(state_dict_metadata=sdm, planner_data=planner_data)


def merge_cached(payloads: list[LocalPlanPayload], cached: list[LocalPlanPayload] | None) -> list[LocalPlanPayload]:
    """Ranks whose local plan did not change sent only their summaries: their packed plans come from
    the cache."""
    out = []
    for i, p in enumerate(payloads):
        if p.packed is not None:
            out.append(p)
        elif cached is None:
            raise UCPError(
                f"rank {i} sent a cached plan (enable_plan_caching), but the coordinator's plan cache is empty",
                hint="give every rank a planner configured alike (enable_plan_caching on all or none) and the "
                "same planner class",
            )
        else:
            out.append(p.with_packed(cached[i].packed))
    return out


# -- the rank's final plan -------------------------------------------------------------------------


def final_items(structure: PlanStructure, items: LocalItems, answer: RankAnswer) -> list[WriteItem]:
    """This rank's ``WriteItem`` list: its items the coordinator kept, and the reduced atoms it writes."""
    out = []
    names, shapes, dtypes = structure.names, structure.shapes, structure.dtypes
    for i in np.nonzero(answer.mask())[0].tolist():
        a = int(items.atom[i])
        kind = ItemKind(int(items.kind[i]))
        if kind == ItemKind.BYTES:
            out.append(WriteItem(index=MetadataIndex(names[a]), type=WriteItemType.BYTE_IO))
            continue
        nd = len(shapes[a])
        out.append(
            tensor_item(
                names[a], items.off[i, :nd].tolist(), items.size[i, :nd].tolist(), shapes[a], dtype_of(dtypes[a]), kind
            )
        )
    for r in answer.reduced:
        if r.shape is None:
            out.append(WriteItem(index=MetadataIndex(r.atom), type=WriteItemType.BYTE_IO))
        else:
            out.append(tensor_item(r.atom, (0,) * len(r.shape), r.shape, r.shape, r.dtype, ItemKind.TENSOR))
    return out


def tensor_item(
    name: str, offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int], dtype: torch.dtype, kind: ItemKind
) -> WriteItem:
    offs, sizes = torch.Size(offsets), torch.Size(sizes)
    return WriteItem(
        index=MetadataIndex(name, offs),
        type=WriteItemType.TENSOR if kind == ItemKind.TENSOR else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offs, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


# -- dedup of replicated pieces: every rank's items in one table, and one writer per piece ---------------------------
# DCP's ``dedup_save_plans`` walks ``WriteItem`` objects; here all ranks' items are rows of a few
# arrays, a piece is a row key ``(atom, offsets)``, and pieces held by several ranks go to the least
# loaded holder (or to the lowest rank), as in DCP.


@dataclass
class Rows:
    """All ranks' items, concatenated in rank order (one row each)."""

    rank: np.ndarray
    """The rank that holds the row."""
    atom: np.ndarray
    """Global atom id."""
    kind: np.ndarray
    """:class:`~ucp_dcp.planning.payloads.ItemKind`."""
    off: np.ndarray
    """``(n, D)`` offsets, -1 padded."""
    size: np.ndarray
    """``(n, D)`` sizes, -1 padded."""

    @classmethod
    def concat(cls, items: list[LocalItems], remaps: list[np.ndarray]) -> Rows:
        """``items`` per rank, with ``remaps`` per rank from its atom indices to global atom ids."""
        width = max([it.off.shape[1] if it.off.ndim == 2 else 0 for it in items] + [1])
        counts = [len(it.atom) for it in items]
        rank = np.repeat(np.arange(len(items)), counts)
        if sum(counts):
            atom = np.concatenate([remap[it.atom] for remap, it in zip(remaps, items)])
            kind = np.concatenate([it.kind for it in items])
        else:
            atom, kind = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        off = np.full((len(atom), width), -1, dtype=np.int64)
        size = np.full((len(atom), width), -1, dtype=np.int64)
        pos = 0
        for it in items:
            n, d = it.off.shape if it.off.ndim == 2 else (len(it.atom), 0)
            off[pos : pos + n, :d] = it.off
            size[pos : pos + n, :d] = it.size
            pos += n
        return cls(rank, atom, kind, off, size)

    @property
    def volume(self) -> np.ndarray:
        """Elements per row (objects: 1)."""
        return np.where(self.size >= 0, self.size, 1).prod(axis=1)


def choose_writers(rows: Rows, nbytes: np.ndarray, ranks: int, lowest_rank: bool) -> np.ndarray:
    """A bool mask over ``rows``: one writer for every piece. A piece on several ranks goes to the
    lowest one with ``lowest_rank``, else to the holder with the fewest bytes to write so far
    (largest pieces first)."""
    key = np.concatenate([rows.atom[:, None], rows.off], axis=1)
    _, inverse, cnt = np.unique(
        np.ascontiguousarray(key).view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))),
        return_inverse=True,
        return_counts=True,
    )
    inverse = inverse.reshape(-1)
    keep = np.zeros(len(rows.atom), dtype=bool)
    shared = cnt[inverse] > 1
    keep[~shared] = True
    if not shared.any():
        return keep
    rank = rows.rank
    load = np.bincount(rank[~shared], weights=nbytes[~shared], minlength=ranks).astype(np.int64)
    idx = np.nonzero(shared)[0]
    order = idx[np.lexsort((rank[idx], inverse[idx]))]
    groups = np.split(order, np.nonzero(np.diff(inverse[order]))[0] + 1)
    if lowest_rank:
        for g in groups:
            keep[g[0]] = True
        return keep
    for g in sorted(groups, key=lambda g: -int(nbytes[g[0]])):
        w = g[int(np.argmin(load[rank[g]]))]
        keep[w] = True
        load[rank[w]] += int(nbytes[w])
    return keep


def replica_copies_to_verify(
    payloads: Sequence[LocalPlanPayload],
    structures: Sequence[PlanStructure],
    items: Sequence[LocalItems],
    keep: Sequence[np.ndarray],
) -> dict[int, list[PieceKey]]:
    """Per rank, the deferred replicated pieces it holds but another rank writes: it hashes its
    copy during the write and the storage writer compares it with the written one's checksums.
    Refuses deferred pieces when some rank's storage writer does not compare them."""
    deferred = {(a, tuple(o)) for p in payloads for a, o, _ in p.deferred}
    if not deferred:
        return {}
    blind = [rank for rank, p in enumerate(payloads) if p.deferred and not p.writer_verifies]
    if blind:
        writers = sorted({_writer_name(payloads[r]) for r in blind})
        raise UCPError(
            f"UCPSavePlanner(replica_digests='writer') with {' / '.join(writers)}: rank(s) {blind[:8]} left their "
            "replica comparison to the storage writer, which does not compare replicas; refused before any write",
            wanted="UCPFileSystemWriter with checksums=True",
            saved=writers,
            hint="save with storage_writer=UCPFileSystemWriter(path) and checksums on (ucp_dcp.save does), or "
            "leave replica_digests at 'plan' (any storage writer)",
        )
    writer: dict[PieceKey, int] = {}
    for rank, (st, its, kept) in enumerate(zip(structures, items, keep)):
        for i in np.nonzero(kept)[0].tolist():
            a = int(its.atom[i])
            if st.shapes[a] is None:
                continue
            key = (st.names[a], tuple(its.off[i, : len(st.shapes[a])].tolist()))
            if key in deferred:
                writer[key] = rank
    out: dict[int, list[PieceKey]] = {}
    for rank, p in enumerate(payloads):
        mine = [(a, tuple(o)) for a, o, _ in p.deferred if writer.get((a, tuple(o)), rank) != rank]
        if mine:
            out[rank] = mine
    return out


def _writer_name(payload: LocalPlanPayload) -> str:
    """The storage writer a payload came through, as a message names it."""
    if payload.writer is None:
        return "a storage writer that is not ucp_dcp's (e.g. DCP's FileSystemWriter)"
    return f"{payload.writer} (checksums off)" if not payload.writer_verifies else payload.writer


# -- replicas saved as their mean -------------------------------------------------------------------------------------
# ``Replicated(check="average")``: every rank holding a copy of a replicated piece sends it to the
# rank that writes the piece, which saves the mean.
#
# The coordinator picks the writers (:func:`average_writers`, after the dedup); at ``finish_plan``
# every rank takes part in the exchange (:func:`exchange_averages`): point-to-point messages between
# global ranks, so any save group works.


Duties = dict[PieceKey, tuple[int, list[int]]]
"""Averaged pieces a rank holds -> ``(global rank that writes the mean, global ranks holding a copy)``."""


def is_averaged(r: Resolved) -> bool:
    """The entry is a tensor under ``Replicated(check="average")``."""
    return r.replicated is not None and r.replicated.check == "average" and isinstance(r.value, torch.Tensor)


def average_writers(
    payloads: Sequence[LocalPlanPayload],
    items: Sequence[LocalItems],
    keep: Sequence[np.ndarray],
    structures: Sequence[PlanStructure],
) -> dict[int, Duties]:
    """Per rank (index into ``payloads``) with averaged pieces: who holds them and who writes them.
    ``items``, ``keep`` (the writer masks) and ``structures`` are per rank."""
    holders: dict[PieceKey, list[int]] = defaultdict(list)
    for p in payloads:
        for key in p.averaged:
            holders[key].append(p.global_rank)
    if not holders:
        return {}
    rank_of = [p.global_rank for p in payloads]
    writer: dict[PieceKey, int] = {}
    for r, (it, mask, st) in enumerate(zip(items, keep, structures)):
        for i in np.nonzero(mask)[0].tolist():
            a = int(it.atom[i])
            key = (st.names[a], tuple(it.off[i, : len(st.shapes[a] or ())].tolist()))
            if key in holders:
                writer[key] = rank_of[r]
    out: dict[int, Duties] = {}
    for r, g in enumerate(rank_of):
        mine = {k: (writer[k], sorted(h)) for k, h in holders.items() if g in h and k in writer}
        if mine:
            out[r] = mine
    return out


def exchange_averages(duties: Duties, resolved: Sequence[Resolved]) -> dict[PieceKey, torch.Tensor]:
    """Send this rank's copies to their writers and average what it writes; returns the means it
    writes. Called on every rank when any rank averages (pieces are visited in the same order
    everywhere)."""
    if threading.current_thread() is not threading.main_thread():
        atom = next((a for a, _ in duties), "a Replicated(check='average') atom")
        raise PatternError(
            "Replicated(check='average') needs collectives and cannot run inside async_save's "
            f"background thread (atom '{atom}')",
            atom=atom,
            hint="use a synchronous dcp.save, or check='error'/'warn' with async_save",
        )
    p2p_group()  # every rank at once: a side group, if the default group cannot carry host tensors
    if not duties:
        return {}
    me = dist.get_rank()
    frags = {(f.atom, f.box.offsets): (r, f) for r in resolved if is_averaged(r) for f in r.fragments}
    out = {}
    for key in sorted(duties):
        writer, holders = duties[key]
        r, f = frags[key]
        local = f.view(r.local).detach()
        # device tensors over NCCL, host tensors over gloo (the default group or a side group)
        device, group = send_device(local)
        mine = local.to(device=device, dtype=torch.float64).contiguous()
        if me != writer:
            dist.isend(mine, writer, group=group).wait()
            continue
        parts = {me: mine}
        bufs = {h: torch.empty_like(mine) for h in holders if h != me}
        for w in [dist.irecv(buf, h, group=group) for h, buf in bufs.items()]:
            w.wait()
        parts.update(bufs)
        total = sum(parts[h] for h in sorted(parts))
        out[key] = (total / len(parts)).to(device=r.local.device, dtype=r.local.dtype)
    return out
