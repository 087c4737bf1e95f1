"""Save-plan payloads: what a saving rank sends the coordinator, what the coordinator answers, and
their wire form.

DCP gathers every rank's ``SavePlan`` on the coordinator with pickle, one ``WriteItem`` object per
item: O(ranks x tensors) Python objects (about two minutes at 1024 ranks x 1000 tensors). A UCP rank
sends an empty item list and one :class:`LocalPlanPayload` in ``SavePlan.planner_data``:

* a :class:`PackedPlan`: the rank's :class:`PlanStructure` (atom names, shapes, dtypes, flatten
  paths, catalog records), identical on ranks of the same shape (all data-parallel peers), pickled
  and LZMA-compressed with a hash so the coordinator decodes each distinct structure once, and its
  write items as four delta-encoded, compressed numpy arrays (:class:`LocalItems`);
* small summaries for the coordinator's checks, which travel even when plan caching keeps the
  packed plan on the coordinator.

The coordinator answers each rank with a :class:`RankAnswer`: a bit mask over the rank's items
(those it writes), plus the reduced values and averaging duties it has. Payloads pickle as the
tuple of their fields (no field names on the wire, :class:`Compact`), so they are no larger than dicts with
short keys would be; integer arrays travel delta-encoded and compressed (:func:`pack_rows`). Those two encodings
are shared: the storage reader's own wire types (its read-once summary and the coordinator's answer,
:mod:`ucp_dcp.storage.transport`) are built on them.

Kept in one module (about 450 lines): every payload the planners put in DCP's plan gather and scatter, and
their wire forms, in one place.
"""

from __future__ import annotations

import copyreg
import enum
import hashlib
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch

from ..errors import UCPError
from ..layout.fragments import Box

try:  # in every CPython build that has liblzma (nearly all); else structures travel zlib-compressed
    import lzma
except ImportError:  # pragma: no cover
    lzma = None  # type: ignore[assignment]

__all__ = [
    "ReadOnceMode",
    "READ_ONCE_MODES",
    "Compact",
    "pack_rows",
    "unpack_rows",
    "LoadPlanPayload",
    "ItemKind",
    "Offsets",
    "PieceKey",
    "ReplicaKey",
    "dtype_code",
    "has_dtype_code",
    "dtype_of",
    "PlanStructure",
    "LocalItems",
    "PackedPlan",
    "RuleUsage",
    "LocalPlanPayload",
    "ReducedItem",
    "RankAnswer",
]

ReadOnceMode = Literal["hosts", "ranks", "off"]
"""Who receives saved bytes several ranks need: only ranks on other hosts than the reader, every other rank, or
nobody (every rank reads what it needs)."""
READ_ONCE_MODES: tuple[str, ...] = get_args(ReadOnceMode)

Offsets = tuple[int, ...]
"""Start index per dim of a piece of an atom (empty for a 0-d tensor)."""
PieceKey = tuple[str, Offsets | None]
"""``(atom, offsets)``: one saved piece; ``offsets`` is None for an object (``BYTE_IO``)."""
ReplicaKey = tuple[str, Box | None]
"""What a value digest covers: an atom's whole value ``(atom, None)`` (plain tensors, objects) or
one piece ``(atom, box)`` of a DTensor."""


class ItemKind(enum.IntEnum):
    """How one row of :class:`LocalItems` is written (stored as uint8)."""

    SHARD = 0
    """A piece of a tensor (DCP allows one ``TENSOR`` item per key: DTensor shards, fused blocks)."""
    TENSOR = 1
    """A whole plain tensor."""
    BYTES = 2
    """An object, ``torch.save``-d (``BYTE_IO``)."""


_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    # appended (codes never move): the rest of what stock DCP saves
    torch.complex32,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
)
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def has_dtype_code(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be saved (stock DCP saves no other dtype either)."""
    return dtype in _CODE


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a dtype (an index into a fixed table)."""
    return _CODE[dtype]


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a wire code."""
    return _DTYPES[code]


class Compact:
    """Pickles as its class and the tuple of its field values: no field names on the wire, and
    no ``__init__`` call to unpickle (payloads arrive by the thousand on the coordinator). A base of frozen
    dataclasses, the planners' payloads here and the storage reader's wire types."""

    __match_args__: tuple[str, ...]  # the dataclass's field names, in order

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (copyreg.__newobj__, (type(self),), tuple(getattr(self, f) for f in self.__match_args__))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__dict__.update(zip(self.__match_args__, state))


@dataclass(frozen=True)
class PlanStructure(Compact):
    """The part of a rank's plan that is the same on every rank of the same shape."""

    names: list[str]
    """Atom names, in first-use order; rows of :class:`LocalItems` index into this list."""
    shapes: list[tuple[int, ...] | None]
    """Global shape per atom (None: an object)."""
    dtypes: list[int]
    """:func:`dtype_code` per atom (-1: an object)."""
    paths: dict[str, Any]
    """Atom -> path in the nested state dict (DCP's flatten mappings)."""
    catalog: dict[str, Any]
    """This rank's catalog records (``meshes`` and ``atoms``)."""
    whole_digests: list[str]
    """Atoms whose whole value is digested (plain tensors, objects), sorted."""
    piece_digests: list[tuple[str, Offsets, Offsets]]
    """DTensor pieces digested: ``(atom, offsets, sizes)``, sorted."""

    @property
    def replica_keys(self) -> list[ReplicaKey]:
        """Keys of the digests a rank sends, in the order of its digest array."""
        return [(a, None) for a in self.whole_digests] + [(a, Box(o, s)) for a, o, s in self.piece_digests]


@dataclass
class LocalItems:
    """One rank's write items, as arrays (one row per item)."""

    atom: np.ndarray
    """int32 index into :attr:`PlanStructure.names`."""
    kind: np.ndarray
    """uint8 :class:`ItemKind`."""
    off: np.ndarray
    """int64 ``(n, D)`` offsets, -1 padded."""
    size: np.ndarray
    """int64 ``(n, D)`` sizes, -1 padded."""

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, ItemKind, Offsets, Offsets]]) -> LocalItems:
        """From ``(atom index, kind, offsets, sizes)`` rows."""
        width = max([len(o) for _, _, o, _ in rows] + [1])
        off = np.full((len(rows), width), -1, dtype=np.int64)
        size = np.full((len(rows), width), -1, dtype=np.int64)
        for i, (_, _, o, s) in enumerate(rows):
            off[i, : len(o)] = o
            size[i, : len(s)] = s
        return cls(
            np.array([r[0] for r in rows], dtype=np.int32), np.array([r[1] for r in rows], dtype=np.uint8), off, size
        )


@dataclass(frozen=True)
class PackedPlan(Compact):
    """A rank's structure and items, compressed for the gather.

    The structure is most of a rank's plan (its names appear in the atom list, the flatten paths, the catalog
    records and the digest list, far apart in the pickle) and every rank sends it: LZMA, whose window spans
    the whole pickle, makes it a third of what zlib's 32 KiB window made of it (1000 sharded tensors and
    1000 scalars: 13 KB against 44 KB, ~8 ms to pack). The items are rows of like numbers: delta-encoded
    along the rows (:func:`pack_rows`' encoding), runs of equal rows compress to almost nothing."""

    structure: bytes
    """The pickled :class:`PlanStructure`, compressed: a codec byte (``x`` LZMA, ``z`` zlib where Python has
    no ``lzma``) then the compressed bytes."""
    structure_hash: bytes
    """16-byte BLAKE2b of ``structure``: equal on ranks with equal structures."""
    items: bytes
    """zlib-compressed pickle of the four :class:`LocalItems` arrays, each delta-encoded along its rows."""

    @classmethod
    def pack(cls, structure: PlanStructure, items: LocalItems) -> PackedPlan:
        raw = pickle.dumps(structure, protocol=5)
        s = b"x" + lzma.compress(raw, preset=0) if lzma is not None else b"z" + zlib.compress(raw, 1)
        arrays = (
            _delta(items.atom.astype(np.int32)),
            _delta(items.kind.astype(np.uint8)),
            _delta(items.off.astype(np.int64)),
            _delta(items.size.astype(np.int64)),
        )
        it = zlib.compress(pickle.dumps(arrays, protocol=5), 6)
        return cls(s, hashlib.blake2b(s, digest_size=16).digest(), it)

    def unpack_structure(self) -> PlanStructure:
        codec, blob = self.structure[:1], self.structure[1:]
        if codec == b"x":
            if lzma is None:
                raise UCPError(
                    "a rank sent its plan LZMA-compressed, and this Python has no lzma module",
                    hint="run every rank of the job on the same Python build",
                )
            return pickle.loads(lzma.decompress(blob))
        return pickle.loads(zlib.decompress(blob))

    def unpack_items(self) -> LocalItems:
        return LocalItems(*(_undelta(a) for a in pickle.loads(zlib.decompress(self.items))))


def _delta(a: np.ndarray) -> np.ndarray:
    """Each row minus the one before it (integers wrap; :func:`_undelta` undoes it exactly)."""
    out = np.ascontiguousarray(a).copy()
    if len(a) > 1:
        out[1:] -= a[:-1]
    return out


def _undelta(d: np.ndarray) -> np.ndarray:
    return np.cumsum(d, axis=0, dtype=d.dtype) if len(d) else d.copy()


def pack_rows(a: np.ndarray | None) -> tuple[str, tuple[int, ...], bytes] | None:
    """An integer array (rows along its first axis) for the wire: each row minus the one before it (runs
    of like rows become runs of equal ones), zlib-compressed; ``(dtype, shape, bytes)``. The storage reader's
    read-once summary travels so (a rank's reads are runs of like rows: the same lengths, offsets a stride apart)."""
    if a is None:
        return None
    return (a.dtype.str, a.shape, zlib.compress(_delta(a).tobytes(), 6))


def unpack_rows(packed: tuple[str, tuple[int, ...], bytes] | None) -> np.ndarray | None:
    """The array :func:`pack_rows` packed."""
    if packed is None:
        return None
    dtype, shape, blob = packed
    return _undelta(np.frombuffer(zlib.decompress(blob), dtype=dtype).reshape(shape))


@dataclass(frozen=True)
class RuleUsage(Compact):
    """What one rank's plan tells the coordinator about pattern rules and index maps."""

    used: list[int] = field(default_factory=list)
    """Indices of the declared rules that matched something on this rank."""
    claims: list[tuple[str, int, int | None]] = field(default_factory=list)
    """``(map key, global index, owner)`` claimed by this rank's entries."""
    map_totals: dict[str, int | None] = field(default_factory=dict)
    """Index-map key -> the total number of layers/experts it declares (None: unknown)."""


@dataclass(frozen=True)
class LocalPlanPayload(Compact):
    """What a saving rank sends the coordinator (``SavePlan.planner_data``)."""

    packed: PackedPlan | None
    """Structure and items; None when plan caching found them unchanged since the last save (the
    coordinator takes them from its cache)."""
    digests: bytes
    """zlib-compressed uint64 value digests, in :attr:`PlanStructure.replica_keys` order."""
    tie_mismatches: list[str]
    """Tied atoms whose copies on this rank already differ."""
    reduced: dict[str, Any]
    """``Reduce`` atom -> this rank's value (it is reduced on the coordinator, not written here)."""
    data_slot: int | None
    """This rank's data-parallel slot for ``Reduce`` rules (None: the rank is its own slot)."""
    usage: RuleUsage
    """Rule usage and index claims, for the strict-rule and ownership checks."""
    warn_atoms: list[str]
    """``Replicated(check="warn")`` atoms: copies that differ only warn."""
    averaged: list[PieceKey]
    """``Replicated(check="average")`` pieces this rank holds."""
    coordinator: bool
    """This rank is DCP's coordinator (it writes the reduced values)."""
    global_rank: int
    """This rank in the default group (averaging messages go between global ranks)."""
    deferred: list[tuple[str, Offsets, Offsets]] = field(default_factory=list)
    """Replicated pieces this rank holds whose digests it did not compute (``replica_digests="writer"``):
    ``(atom, offsets, sizes)``."""
    writer_verifies: bool = False
    """This rank's storage writer compares replicated pieces after the write (it said so in
    ``prepare_local_plan``, :meth:`acknowledge_writer`)."""
    writer: str | None = None
    """The class name of the storage writer that acknowledged this payload (None: the writer is not a
    ucp_dcp one and left it unmarked), named when a save needs what that writer does not do."""

    def acknowledge_writer(self, writer: str, compares_replicas: bool) -> LocalPlanPayload:
        """This payload, marked by the storage writer (:class:`~ucp_dcp.planning.handshake.WriterAcknowledgement`):
        its class name and whether it compares the deferred replicated pieces."""
        out = object.__new__(LocalPlanPayload)
        out.__dict__.update(self.__dict__, writer_verifies=compares_replicas, writer=writer)
        return out

    def with_packed(self, packed: PackedPlan | None) -> LocalPlanPayload:
        """This payload with another packed plan (``dataclasses.replace`` without its cost)."""
        out = object.__new__(LocalPlanPayload)
        out.__dict__.update(self.__dict__, packed=packed)
        return out


@dataclass(frozen=True)
class ReducedItem(Compact):
    """A ``Reduce`` atom the coordinator writes: one whole tensor or one object."""

    atom: str
    """Atom name."""
    shape: tuple[int, ...] | None
    """Tensor shape; None for an object."""
    dtype: torch.dtype | None
    """Tensor dtype; None for an object."""


@dataclass(frozen=True)
class RankAnswer(Compact):
    """What the coordinator answers one rank (``SavePlan.planner_data`` of its global plan)."""

    keep: bytes
    """``np.packbits`` of the mask over the rank's items: True for the items it writes."""
    count: int
    """Number of the rank's items (the length of the mask)."""
    reduced: list[ReducedItem] = field(default_factory=list)
    """Reduced atoms this rank writes (the coordinator only)."""
    averages: dict[PieceKey, tuple[int, list[int]]] = field(default_factory=dict)
    """Averaged pieces this rank holds -> ``(global rank that writes the mean, global ranks holding a copy)``."""
    exchange: bool = False
    """Some rank averages: every rank takes part in setting up the exchange."""
    verify: list[PieceKey] = field(default_factory=list)
    """Replicated pieces this rank holds and another rank writes: the storage writer hashes this
    rank's copy and compares it with the written one's block checksums before the commit."""

    @classmethod
    def from_mask(cls, keep: np.ndarray, **rest: Any) -> RankAnswer:
        return cls(np.packbits(keep).tobytes(), len(keep), **rest)

    def mask(self) -> np.ndarray:
        """The bool mask over the rank's items."""
        return np.unpackbits(np.frombuffer(self.keep, dtype=np.uint8), count=self.count).astype(bool)


# -- load ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPlanPayload(Compact):
    """What a loading rank's planner tells the coordinator (``LoadPlan.planner_data``); its read
    items stay on the rank (the storage reader sends its own summary of them in ``LoadPlan.storage_data``)."""

    usage: RuleUsage
    """Rules this rank's targets matched and the index-map entries they claim."""
    read_once: ReadOnceMode = "hosts"
    """Who receives saved bytes several ranks need (``hosts`` | ``ranks`` | ``off``): the
    planner's wish, which a reader honours unless it was given its own."""
    keeps_items: bool = True
    """The planner puts its read items back in ``finish_plan``: the reader may leave them out of
    the gathered plan."""
    meshes: dict[tuple[int, ...], bytes] = field(default_factory=dict)
    """This rank's DTensor target atoms by their mesh's rank set (:func:`ucp_dcp.layout.structure.target_meshes`):
    one atom wanted whole on two meshes is a forgotten stage/expert map."""
    map_reads: list[str] = field(default_factory=list)
    """Saved atoms this rank reads whose names number an entry of an index map the checkpoint was saved
    with and this load lacks (``layers.<i>``); empty when no map is lacking. Ranks that read the same
    such names while the checkpoint's other entries go unread forgot the map
    (:mod:`ucp_dcp.planning.load_steps`): what meshes show for DTensors, for
    plain tensors."""
    cache_key: bytes | None = None
    """The key this plan is cached under (``UCPLoadPlanner(cache_plans=True)``, :mod:`ucp_dcp.planning.plan_cache`):
    the coordinator keeps the payload by it, and a later load of the rank sends only the key; None: not cached."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # the rank sets of ``meshes`` travel packed: a data-parallel mesh's ranks are O(world) a rank, O(world^2)
        # in the gather (16,384 ranks: 31 KB of the 40 KB a rank sent), and a run of strided ranks packs to bytes
        state = tuple(_wire_meshes(v) if f == "meshes" else v for f, v in zip(self.__match_args__, self._fields()))
        return (copyreg.__newobj__, (type(self),), state)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__dict__.update(zip(self.__match_args__, state))
        self.__dict__["meshes"] = _unwire_meshes(self.__dict__["meshes"])

    def _fields(self) -> list[Any]:
        return [getattr(self, f) for f in self.__match_args__]


_PACKED_RANKS: dict[int, tuple[tuple[int, ...], bytes]] = {}
"""id of a mesh's rank tuple -> (the tuple, kept alive, its packed bytes): the ranks of a mesh are one tuple object
(:attr:`ucp_dcp.layout.placements.MeshInfo.key`), packed once."""
_UNPACKED_RANKS: dict[bytes, tuple[int, ...]] = {}
"""Packed rank bytes -> the rank tuple (on the coordinator: every rank of a mesh sends the same bytes)."""


def _wire_meshes(meshes: Any) -> Any:
    out = []
    for (ranks, position), names in meshes.items():
        hit = _PACKED_RANKS.get(id(ranks))
        if hit is None or hit[0] is not ranks:
            if len(_PACKED_RANKS) > 4096:
                _PACKED_RANKS.clear()
            hit = _PACKED_RANKS[id(ranks)] = (ranks, _pack_ints(ranks))
        out.append((hit[1], position, names))
    return out


def _unwire_meshes(wire: Any) -> dict[tuple[Any, ...], bytes]:
    if isinstance(wire, dict):
        return wire
    out = {}
    for packed, position, names in wire:
        ranks = _UNPACKED_RANKS.get(packed)
        if ranks is None:
            if len(_UNPACKED_RANKS) > 4096:
                _UNPACKED_RANKS.clear()
            ranks = _UNPACKED_RANKS[packed] = tuple(
                int(r) for r in _undelta(np.frombuffer(zlib.decompress(packed), "<i8"))
            )
        out[(ranks, position)] = names
    return out


def _pack_ints(values: tuple[int, ...]) -> bytes:
    return zlib.compress(_delta(np.asarray(values, dtype="<i8")).tobytes(), 6)
