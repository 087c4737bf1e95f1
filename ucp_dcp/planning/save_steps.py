"""The save plan: each rank's local plan, the coordinator's global plan and metadata, and the
``WriteItem`` list a rank rebuilds from the coordinator's answer.

The split follows DCP's ``default_planner``: :func:`build_local` is ``create_local_plan``'s work,
:func:`global_plan` is ``create_global_plan``'s, :func:`final_items` is ``finish_plan``'s. Unlike
DCP, plans travel as arrays (:mod:`ucp_dcp.planning.payloads`) and the coordinator works on all ranks' items at
once: dedup of replicated pieces by row keys, volume and bounds checks per atom with ``bincount``.

Kept in one module (over 400 lines), as DCP's ``default_planner.py`` keeps its three phases together:
the local plan, the global plan and the final items share the row layout of the plan arrays.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
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

from ..errors import AmbiguousLayoutError, UCPError
from ..layout.fragments import Fragment
from ..layout.patterns import Patterns
from ..layout.placements import Layout, dtype_name
from ..layout.shards import global_shape
from ..options import UCPOptions
from . import catalog as cat_mod
from .averaging import average_writers, is_averaged
from .catalog_record import Catalog
from .consistency import check_coverage, check_padding, replica_digests, tie_mismatches
from .dedup import Rows, choose_writers, replica_copies_to_verify
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
    "LocalPlan",
    "live_entries",
    "build_local",
    "local_payload",
    "GlobalSave",
    "structures_by_hash",
    "plan_global",
    "global_plan",
    "merge_cached",
    "final_items",
    "write_rows",
    "tensor_item",
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
