"""Carry bytes read by one rank to the other ranks that need the same saved bytes.

The coordinator's load plan names, for every piece of storage several ranks need, one reader; the
reader sends the piece to the others after its own reads. Pieces travel in *bundles*: a piece of
at least ``SOLO`` bytes alone (sent from, and received into, tensor memory: no copy on either
side), smaller pieces with the same holders packed up to ``BUNDLE`` bytes. Each bundle is one
point-to-point message per consumer on the default group (global ranks): an int64 header
``(status, nbytes)`` then the payload, tagged by its position among the pair's messages
(:mod:`ucp_dcp.storage.exchange`: the exchange itself, failures included: a failed reader sends its
error instead of the data). A consumer receives one bundle at a time, so its extra memory is one
packed bundle at most.

Messages are host bytes, on the group :func:`ucp_dcp.planning.collectives.p2p_group` picks (the default
group, or a gloo side group when the default group is NCCL only).

What travels in DCP's plan gather and scatter for this is storage's own: each rank's :class:`ReadSummary`
(:func:`local_summary`) in ``LoadPlan.storage_data``, and the coordinator's :class:`TransportPlan` per rank
(:func:`plan_transport`) back. The planner's side only says which mode it wishes
(:class:`~ucp_dcp.planning.handshake.ReadOnceRequest`).
"""

from __future__ import annotations

import copyreg
import hashlib
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .. import settings
from ..planning.payloads import READ_ONCE_MODES, Compact, ReadOnceMode, pack_rows, unpack_rows

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLE",
    "SOLO",
    "READ_ONCE_MODES",
    "ReadSummary",
    "TransportPlan",
    "Incoming",
    "assign_readers",
    "piece_ids",
    "read_rows",
    "read_sizes",
    "as_bytes_tensor",
    "read_summary",
    "local_summary",
    "plan_transport",
]


BUNDLE = 16 << 20
"""Small shared pieces with the same holders are packed into bundles of up to this many bytes, each
with one reader: a job's replicated scalars become one message per consumer, not one per scalar."""
SOLO = 1 << 20
"""A shared piece of at least this many bytes is a bundle of its own (sent zero-copy)."""


def assign_readers(
    keys_by_rank: Sequence[np.ndarray],
    sizes_by_rank: Sequence[np.ndarray],
    bundle_bytes: int = BUNDLE,
    solo_bytes: int = SOLO,
    hosts: np.ndarray | None = None,
) -> list[dict]:
    """For pieces needed by several ranks, pick one reader each. ``keys_by_rank[r]`` are the key rows
    (``(n, w)`` integers, :func:`read_rows`; equal rows: the same piece, :func:`piece_ids`) of rank r's
    pieces, ``sizes_by_rank[r]`` their byte sizes.

    Pieces of at least ``solo_bytes`` are bundles of their own; smaller pieces with the same holders
    are packed into bundles of at most ``bundle_bytes``. Each bundle, largest first, goes to the
    holder with the fewest bytes assigned so far (counting what it reads for itself), which spreads
    reads over ranks and hence files. With ``hosts`` (a host id per rank), holders on the reader's
    host read for themselves (their page cache is the reader's) and only other hosts receive.

    Returns, per rank, ``{"send": [(pieces, dsts)], "recv": {src: [pieces, ...]}}``: pieces are
    indices into that rank's own key array (nothing but indices travels back), ``dsts`` the
    consumers of a bundle (a rank holding the same bytes twice appears twice). A reader's messages
    to ``dst`` are its bundles in list order, each once per occurrence of ``dst``; ``recv[src]``
    lists the pieces of those messages in the same order. Plan size is O(pieces + holders) per
    bundle, not O(pieces x holders)."""
    n = len(keys_by_rank)
    out: list[dict] = [{"send": [], "recv": {}} for _ in range(n)]
    counts = [len(k) for k in keys_by_rank]
    if sum(counts) == 0:
        return out
    sizes = np.concatenate(sizes_by_rank).astype(np.int64)
    owner = np.repeat(np.arange(n), counts)
    local = np.concatenate([np.arange(c) for c in counts])
    inverse, cnt = piece_ids(keys_by_rank)
    shared = cnt[inverse] > 1
    if not shared.any():
        return out
    load = np.zeros(n, dtype=np.int64)
    np.add.at(load, owner[~shared], sizes[~shared])  # every rank reads its unshared pieces itself
    classes = _holder_classes(shared, inverse, owner, local)
    bundles = _bundles(classes, sizes, inverse, owner.dtype, bundle_bytes, solo_bytes)
    for nbytes, holders, entries in sorted(bundles, key=lambda b: -b[0]):
        _assign(out, load, nbytes, holders, local[entries], hosts)
    return out


def piece_ids(keys_by_rank: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One id per distinct key row over all ranks' rows (concatenated in rank order), and each id's count.

    Rows (integers, ``(n, w)``; ranks' widths may differ: narrower rows are padded with -1) are sorted by a
    64-bit mix of their columns and compared whole with their neighbours, so equal rows share an id and
    unequal ones never do (two rows whose mixes collide may get two ids: a piece read twice, never one
    piece mistaken for another). Ids follow the order of the mixes."""
    keys = [k.reshape(len(k), k.shape[1] if k.ndim == 2 else 1) for k in keys_by_rank]
    keys = [k.view(np.int64) if k.dtype == np.uint64 else k.astype(np.int64, copy=False) for k in keys]
    n = sum(len(k) for k in keys)
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    width = max(k.shape[1] for k in keys)
    # one column at a time, filled rank by rank (each rank's rows are small: in cache), int32 when every value
    # fits (a 4,096-rank gather of 2,000 items each is 8M rows: touching less memory is most of the time here)
    small = all(len(k) == 0 or (int(k.min()) >= -(2**31) and int(k.max()) < 2**31) for k in keys)
    dtype = np.int32 if small else np.int64
    cols: list[np.ndarray] = []
    for j in range(width):
        col = np.empty(n, dtype=dtype)
        start = 0
        for k in keys:
            col[start : start + len(k)] = k[:, j] if j < k.shape[1] else -1
            start += len(k)
        if not (col == col[0]).all():  # a column equal in every row tells none apart
            cols.append(col)
    cols = cols or [np.zeros(n, dtype=dtype)]
    mix, tmp = np.zeros(n, dtype=np.uint64), np.empty(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j, col in enumerate(cols):
            np.bitwise_xor(mix, col.view(np.uint32 if col.dtype == np.int32 else np.uint64), out=mix)
            np.multiply(mix, np.uint64(0x9E3779B97F4A7C15 + 2 * j), out=mix)
            np.right_shift(mix, np.uint64(29), out=tmp)
            np.bitwise_xor(mix, tmp, out=mix)
    order = np.argsort(mix)
    sm = mix[order]
    new = np.ones(n, dtype=bool)
    new[1:] = sm[1:] != sm[:-1]
    same = np.flatnonzero(~new[1:])  # neighbours whose mixes agree: their rows must too
    if len(same):
        a, b = order[same], order[same + 1]
        differ = np.zeros(len(same), dtype=bool)
        for col in cols:
            differ |= col[a] != col[b]
        new[same + 1] = differ
    ids = np.cumsum(new) - 1
    inverse = np.empty(n, dtype=np.int64)
    inverse[order] = ids
    return inverse, np.bincount(ids)


def _holder_classes(
    shared: np.ndarray, inverse: np.ndarray, owner: np.ndarray, local: np.ndarray
) -> dict[bytes, list[np.ndarray]]:
    """Shared pieces grouped by their exact holder list: each group is one piece's entries, one per
    holder (in rank order)."""
    idx = np.nonzero(shared)[0]
    order = idx[np.lexsort((local[idx], owner[idx], inverse[idx]))]
    starts = np.flatnonzero(np.diff(inverse[order], prepend=-1))
    classes: dict[bytes, list[np.ndarray]] = {}
    for g in np.split(order, starts[1:]):
        classes.setdefault(owner[g].tobytes(), []).append(g)
    return classes


def _bundles(
    classes: dict[bytes, list[np.ndarray]],
    sizes: np.ndarray,
    inverse: np.ndarray,
    rank_dtype: Any,
    bundle_bytes: int,
    solo_bytes: int,
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(bytes, holders, entries: pieces x holders)`` per bundle: pieces of ``solo_bytes`` or more
    alone, smaller ones with the same holders packed up to ``bundle_bytes``, largest first."""
    bundles: list[tuple[int, np.ndarray, np.ndarray]] = []
    for sig in sorted(classes):
        groups = sorted(classes[sig], key=lambda g: (-int(sizes[g[0]]), int(inverse[g[0]])))
        holders = np.frombuffer(sig, dtype=rank_dtype)
        cur: list[np.ndarray] = []
        cur_bytes = 0
        for g in groups + [None]:
            alone = g is not None and int(sizes[g[0]]) >= solo_bytes
            if cur and (g is None or alone or cur_bytes + int(sizes[g[0]]) > bundle_bytes):
                bundles.append((cur_bytes, holders, np.stack(cur)))
                cur, cur_bytes = [], 0
            if g is not None:
                cur.append(g)
                cur_bytes += int(sizes[g[0]])
                if alone:  # travels by itself
                    bundles.append((cur_bytes, holders, np.stack(cur)))
                    cur, cur_bytes = [], 0
    return bundles


def _assign(
    out: list[dict], load: np.ndarray, nbytes: int, holders: np.ndarray, pieces: np.ndarray, hosts: np.ndarray | None
) -> None:
    """Give one bundle to its least-loaded holder; the others (on other hosts, with ``hosts``)
    receive it. ``pieces[:, h]`` are holder ``h``'s own indices of the bundle's pieces."""
    col = int(np.argmin(load[holders]))
    reader = int(holders[col])
    load[reader] += nbytes
    dsts = []
    for h, r in enumerate(holders.tolist()):
        if r == reader:  # the reader's own copies (tied weights): its chunk reads serve them all
            continue
        if hosts is not None and hosts[r] == hosts[reader]:
            continue  # same host: reading is a page-cache hit once the reader has read it
        dsts.append(r)
        out[r]["recv"].setdefault(reader, []).append(pieces[:, h])
    if dsts:
        out[reader]["send"].append((pieces[:, col], np.array(dsts, dtype=np.int64)))


@dataclass
class Incoming:
    """One message a consumer expects."""

    nbytes: int
    """Payload size the consumer computed from its own plan."""
    buffer: Callable[[], torch.Tensor]
    """Returns the uint8 tensor (``nbytes``) to receive into: target memory when it can take the
    bytes as they are, else a fresh buffer."""
    deliver: Callable[[torch.Tensor], None]
    """Called with the filled buffer."""


def as_bytes_tensor(parts: Sequence[Any]) -> torch.Tensor:
    """One uint8 tensor holding ``parts`` back to back: a view (no copy) for a single writable
    buffer, else a packed copy."""
    if len(parts) == 1:
        mv = memoryview(parts[0]).cast("B")
        if not mv.readonly:
            return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)
    total = sum(memoryview(p).nbytes for p in parts)
    out = torch.empty(total, dtype=torch.uint8)
    dst = memoryview(out.numpy())
    pos = 0
    for p in parts:
        mv = memoryview(p).cast("B")
        dst[pos : pos + len(mv)] = mv
        pos += len(mv)
    return out


def read_rows(reads: list[ReadItem], md: Metadata) -> tuple[np.ndarray, bytes]:
    """The saved bytes each read item needs, as one row of numbers per item, and the digest of the name
    numbering the rows use. A row is ``(name, kind, chunk offsets, offsets in the chunk, lengths)``: the name
    numbered in sorted order of the checkpoint's names (the same on every rank that opened the checkpoint, as
    the digest shows), ``kind`` 0 for a tensor piece, 1 for an object, 2 for a tensor piece with no chunk
    offset, -1 padding to the widest row. Two items need the same saved bytes exactly when their rows are
    equal (what :func:`ucp_dcp.storage.format.read_key` tells apart, they tell apart)."""
    rows, _, digest = _rows(reads, md, sizes=False)
    return rows, digest


def _rows(reads: list[ReadItem], md: Metadata, sizes: bool) -> tuple[np.ndarray, np.ndarray | None, bytes]:
    """:func:`read_rows`, and with ``sizes`` :func:`read_sizes` too, in one pass over the items."""
    index, digest, lengths = _name_index(md)
    width = 2 + 3 * max((len(it.lengths) for it in reads if it.type != LoadItemType.BYTE_IO), default=0)
    rows = []
    nbytes = np.empty(len(reads), dtype=np.int64) if sizes else None
    storage = md.storage_data or {}
    tensors = md.state_dict_metadata
    for i, item in enumerate(reads):
        s = item.storage_index
        if item.type == LoadItemType.BYTE_IO:
            row = [index[s.fqn], 1]
            if nbytes is not None:
                where = s.fqn if s.offset is None else (s.fqn, tuple(s.offset))  # an object's: its name alone
                n = lengths.get(where)
                if n is None:
                    n = lengths[where] = int(getattr(storage.get(s), "length", 0))
                nbytes[i] = n
        else:
            ln = item.lengths
            off = s.offset if s.offset is not None else (0 for _ in ln)
            row = [index[s.fqn], 0 if s.offset is not None else 2, *off, *item.storage_offsets, *ln]
            if nbytes is not None:
                nbytes[i] = math.prod(ln) * tensors[s.fqn].properties.dtype.itemsize
        rows.append(row + [-1] * (width - len(row)))
    return np.array(rows, dtype=np.int64).reshape(len(rows), width), nbytes, digest


_NAME_INDEX: dict[int, tuple[Any, Any, tuple[dict[str, int], bytes, dict[Any, int]]]] = {}
"""id of a checkpoint's ``Metadata`` -> (weak reference, its ``state_dict_metadata``, :func:`_name_index`)."""


def _name_index(md: Metadata) -> tuple[dict[str, int], bytes, dict[Any, int]]:
    """The checkpoint's names numbered in sorted order, a digest of that numbering, and the stored length of
    each object read so far (filled as asked: a storage lookup hashes a ``MetadataIndex`` in Python), once per
    metadata object (``plan`` asks for every rank it simulates)."""
    hit = _NAME_INDEX.get(id(md))
    if hit is not None and hit[0]() is md and hit[1] is md.state_dict_metadata:
        return hit[2]
    names = sorted(md.state_dict_metadata)
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=16).digest()
    out: tuple[dict[str, int], bytes, dict[Any, int]] = ({n: i for i, n in enumerate(names)}, digest, {})
    key = id(md)
    try:
        ref = weakref.ref(md, lambda _ref: _NAME_INDEX.pop(key, None))
    except TypeError:
        return out
    _NAME_INDEX[key] = (ref, md.state_dict_metadata, out)
    return out


def read_summary(reads: list[ReadItem], md: Metadata) -> tuple[np.ndarray, np.ndarray]:
    """The saved bytes each read item needs (:func:`read_rows`) and their byte sizes (for read-once)."""
    keys, _ = read_rows(reads, md)
    return keys, read_sizes(reads, md)


def read_sizes(reads: list[ReadItem], md: Metadata) -> np.ndarray:
    """Byte size of the saved bytes each read item needs."""
    sizes = np.empty(len(reads), dtype=np.int64)
    for i, item in enumerate(reads):
        if item.type == LoadItemType.BYTE_IO:
            info = (md.storage_data or {}).get(item.storage_index)
            sizes[i] = int(getattr(info, "length", 0))
        else:
            sizes[i] = (
                math.prod(item.lengths) * md.state_dict_metadata[item.storage_index.fqn].properties.dtype.itemsize
            )
    return sizes


@dataclass(frozen=True)
class ReadSummary(Compact):
    """What a loading rank's storage reader tells the coordinator (``LoadPlan.storage_data``).

    On the wire its arrays travel delta-encoded along the items and zlib-compressed: a rank's reads are
    runs of like rows (the same lengths, offsets a stride apart), a few hundred bytes where 128-bit hashes
    of them took 16 bytes an item (:meth:`__reduce_ex__`)."""

    rank: int
    """The rank's global rank (read-once messages are addressed by it)."""
    mode: ReadOnceMode
    """``hosts`` | ``ranks`` | ``off``."""
    keys: np.ndarray | None = None
    """``(n, w)`` int64: per read item, the saved bytes it needs as a row of numbers
    (:func:`read_rows`), equal across ranks needing the same bytes."""
    sizes: np.ndarray | None = None
    """Byte size of each read item."""
    host: str | None = None
    """Host name (``UCP_DCP_HOST`` or ``socket.gethostname()``)."""
    names: bytes | None = None
    """16-byte digest of the saved names the rows number (:func:`read_rows`): ranks
    that number them alike have equal digests."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # as Compact pickles, but the arrays packed (pack_rows); typeshed does not declare copyreg.__newobj__
        state = (self.rank, self.mode, pack_rows(self.keys), pack_rows(self.sizes), self.host, self.names)
        return (copyreg.__newobj__, (type(self),), state)  # type: ignore[attr-defined]

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        rank, mode, keys, sizes, host, names = state
        self.__dict__.update(
            rank=rank, mode=mode, keys=unpack_rows(keys), sizes=unpack_rows(sizes), host=host, names=names
        )


def local_summary(
    reads: list[ReadItem], md: Metadata, mode: ReadOnceMode, rank: int | None = None, host: str | None = None
) -> ReadSummary:
    """What one loading rank tells the coordinator for read-once: its global rank, its host and
    the saved bytes its reads need and their sizes (no read items). ``rank`` and ``host`` default to this
    process's (``ucp_dcp.tools.dryrun`` passes the simulated rank's)."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if mode == "off":
        return ReadSummary(rank, mode)
    keys, sizes, names = _rows(reads, md, sizes=True)
    host = host or settings.host()
    return ReadSummary(rank, mode, keys, sizes, host, names)


@dataclass(frozen=True)
class TransportPlan(Compact):
    """The coordinator's read-once answer to one rank (``LoadPlan.storage_data``)."""

    send: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    """Bundles this rank reads for others: ``(positions of its read items, consumer global ranks)``."""
    recv: dict[int, list[np.ndarray]] = field(default_factory=dict)
    """``source global rank -> [positions of this rank's read items, per message]``, in order."""
    ranks: list[int] | None = None
    """The load's global ranks when anybody exchanges (a side group is created over them), else None."""
    members: list[int] | None = None
    """Every loading rank (global ranks): the ranks the exchange's gates wait for
    (:mod:`ucp_dcp.planning.checkpoint_group`)."""


def plan_transport(summaries: list[ReadSummary | None]) -> list[TransportPlan]:
    """The coordinator's answer to every rank's :func:`local_summary`: per rank, what it sends and
    receives (global ranks), and, for all, the ranks that exchange (None if nobody does: then no
    side group is created)."""
    if not summaries or any(s is None or s.mode == "off" or s.keys is None for s in summaries):
        return [TransportPlan() for _ in summaries]
    if len({s.names for s in summaries if s is not None}) > 1:
        # ranks numbered the checkpoint's names differently (they opened different metadata): their rows
        # cannot be compared, so every rank reads what it needs
        logger.warning("UCP read-once: the loading ranks opened different checkpoint metadata; every rank reads itself")
        return [TransportPlan() for _ in summaries]
    ranks = [int(s.rank) for s in summaries]
    hosts = None
    if summaries[0].mode == "hosts":
        names = [s.host for s in summaries]
        hosts = np.unique(np.array(names, dtype=object).astype(str), return_inverse=True)[1]
    plans = assign_readers([s.keys for s in summaries], [s.sizes for s in summaries], hosts=hosts)
    glob = np.asarray(ranks, dtype=np.int64)  # plan positions -> global ranks (the p2p group)
    # every rank learns whether anyone exchanges: a side group (NCCL-only jobs) is created by all
    exchanges = any(t["send"] for t in plans)
    return [
        TransportPlan(
            [(pieces, glob[dsts]) for pieces, dsts in t["send"]],
            {ranks[r]: idx for r, idx in t["recv"].items()},
            ranks if exchanges else None,
        )
        for t in plans
    ]
