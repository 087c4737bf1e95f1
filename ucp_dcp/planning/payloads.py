"""Save-plan payloads: what a saving rank sends the coordinator, what the coordinator answers, and
their wire form.

DCP gathers every rank's ``SavePlan`` on the coordinator with pickle, one ``WriteItem`` object per
item: O(ranks x tensors) Python objects (about two minutes at 1024 ranks x 1000 tensors). A UCP rank
sends an empty item list and one :class:`LocalPlanPayload` in ``SavePlan.planner_data``:

* a :class:`PackedPlan`: the rank's :class:`PlanStructure` (atom names, shapes, dtypes, flatten
  paths, catalog records), identical on ranks of the same shape (all data-parallel peers), pickled
  and zlib-compressed with a hash so the coordinator decodes each distinct structure once, and its
  write items as four compressed numpy arrays (:class:`LocalItems`);
* small summaries for the coordinator's checks, which travel even when plan caching keeps the
  packed plan on the coordinator.

The coordinator answers each rank with a :class:`RankAnswer`: a bit mask over the rank's items
(those it writes), plus the reduced values and averaging duties it has. Payloads pickle as the
tuple of their fields (no field names on the wire), so they are no larger than dicts with short
keys would be.
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

from ..layout.fragments import Box

__all__ = [
    "ReadOnceMode",
    "READ_ONCE_MODES",
    "LoadPlanPayload",
    "ReadSummary",
    "TransportPlan",
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


class _Compact:
    """Pickles as its class and the tuple of its field values: no field names on the wire, and
    no ``__init__`` call to unpickle (payloads arrive by the thousand on the coordinator)."""

    __match_args__: tuple[str, ...]  # the dataclass's field names, in order

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (copyreg.__newobj__, (type(self),), tuple(getattr(self, f) for f in self.__match_args__))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__dict__.update(zip(self.__match_args__, state))


@dataclass(frozen=True)
class PlanStructure(_Compact):
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
class PackedPlan(_Compact):
    """A rank's structure and items, compressed for the gather."""

    structure: bytes
    """zlib-compressed pickle of the :class:`PlanStructure`."""
    structure_hash: bytes
    """16-byte BLAKE2b of ``structure``: equal on ranks with equal structures."""
    items: bytes
    """zlib-compressed pickle of the four :class:`LocalItems` arrays."""

    @classmethod
    def pack(cls, structure: PlanStructure, items: LocalItems) -> PackedPlan:
        s = zlib.compress(pickle.dumps(structure, protocol=5), 1)
        arrays = (
            items.atom.astype(np.int32),
            items.kind.astype(np.uint8),
            items.off.astype(np.int64),
            items.size.astype(np.int64),
        )
        it = zlib.compress(pickle.dumps(arrays, protocol=5), 1)
        return cls(s, hashlib.blake2b(s, digest_size=16).digest(), it)

    def unpack_structure(self) -> PlanStructure:
        return pickle.loads(zlib.decompress(self.structure))

    def unpack_items(self) -> LocalItems:
        return LocalItems(*pickle.loads(zlib.decompress(self.items)))


@dataclass(frozen=True)
class RuleUsage(_Compact):
    """What one rank's plan tells the coordinator about pattern rules and index maps."""

    used: list[int] = field(default_factory=list)
    """Indices of the declared rules that matched something on this rank."""
    claims: list[tuple[str, int, int | None]] = field(default_factory=list)
    """``(map key, global index, owner)`` claimed by this rank's entries."""
    map_totals: dict[str, int | None] = field(default_factory=dict)
    """Index-map key -> the total number of layers/experts it declares (None: unknown)."""


@dataclass(frozen=True)
class LocalPlanPayload(_Compact):
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
class ReducedItem(_Compact):
    """A ``Reduce`` atom the coordinator writes: one whole tensor or one object."""

    atom: str
    """Atom name."""
    shape: tuple[int, ...] | None
    """Tensor shape; None for an object."""
    dtype: torch.dtype | None
    """Tensor dtype; None for an object."""


@dataclass(frozen=True)
class RankAnswer(_Compact):
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
class LoadPlanPayload(_Compact):
    """What a loading rank's planner tells the coordinator (``LoadPlan.planner_data``); its read
    items stay on the rank (the storage layer sends a summary of them, :class:`ReadSummary`)."""

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
    (:mod:`ucp_dcp.planning.forgotten_maps`): what meshes show for DTensors, for
    plain tensors."""


@dataclass(frozen=True)
class ReadSummary(_Compact):
    """What a loading rank's storage reader tells the coordinator (``LoadPlan.storage_data``)."""

    rank: int
    """The rank's global rank (read-once messages are addressed by it)."""
    mode: ReadOnceMode
    """``hosts`` | ``ranks`` | ``off``."""
    keys: np.ndarray | None = None
    """``(n, 2)`` uint64: a 128-bit key per read item, equal across ranks needing the same bytes."""
    sizes: np.ndarray | None = None
    """Byte size of each read item."""
    host: str | None = None
    """Host name (``UCP_DCP_HOST`` or ``socket.gethostname()``)."""


@dataclass(frozen=True)
class TransportPlan(_Compact):
    """The coordinator's read-once answer to one rank (``LoadPlan.storage_data``)."""

    send: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """Bundles this rank reads for others: ``(positions of its read items, consumer global ranks)``."""
    recv: dict[int, list[np.ndarray]] = field(default_factory=dict)
    """``source global rank -> [positions of this rank's read items, per message]``, in order."""
    ranks: list[int] | None = None
    """The load's global ranks when anybody exchanges (a side group is created over them), else None."""
    members: list[int] | None = None
    """Every loading rank (global ranks): the ranks the exchange's gates wait for (:mod:`ucp_dcp.planning.watch`)."""
