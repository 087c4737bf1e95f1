"""Carry bytes read by one rank to the other ranks that need the same saved bytes.

The coordinator's load plan names, for every piece of storage several ranks need, one reader; the
reader sends the piece to the others after its own reads. Pieces travel in *bundles*: a piece of
at least ``SOLO`` bytes alone (sent from, and received into, tensor memory: no copy on either
side), smaller pieces with the same holders packed up to ``BUNDLE`` bytes. Each bundle is one
point-to-point message per consumer on the default group (global ranks): an int64 header
``(status, nbytes)`` then the payload, tagged by its position among the pair's messages (:mod:`ucp_dcp.storage.exchange`: the
exchange itself, failures included: a failed reader sends its error instead of the data). A consumer receives one bundle at a
time, so its extra memory is one packed bundle at most.

Messages are host bytes, on the group :func:`ucp_dcp.planning.collectives.p2p_group` picks (the default
group, or a gloo side group when the default group is NCCL only).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..planning.payloads import READ_ONCE_MODES, ReadOnceMode, ReadSummary, TransportPlan
from .format import read_key

__all__ = [
    "BUNDLE",
    "SOLO",
    "READ_ONCE_MODES",
    "Incoming",
    "assign_readers",
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
    """For pieces needed by several ranks, pick one reader each. ``keys_by_rank[r]`` are 128-bit
    keys (``(n, 2)`` uint64) of rank r's pieces, ``sizes_by_rank[r]`` their byte sizes.

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
    keys = np.concatenate([k.reshape(-1, 2) for k in keys_by_rank]).view(np.dtype((np.void, 16))).reshape(-1)
    sizes = np.concatenate(sizes_by_rank).astype(np.int64)
    owner = np.repeat(np.arange(n), counts)
    local = np.concatenate([np.arange(c) for c in counts])
    _, inverse, cnt = np.unique(keys, return_inverse=True, return_counts=True)
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


def read_summary(reads: list[ReadItem], md: Metadata) -> tuple[np.ndarray, np.ndarray]:
    """128-bit keys and byte sizes of the saved bytes each read item needs (for read-once)."""
    keys = np.empty((len(reads), 2), dtype=np.uint64)
    sizes = np.empty(len(reads), dtype=np.int64)
    itemsize: dict[torch.dtype, int] = {}
    for i, item in enumerate(reads):
        keys[i] = np.frombuffer(hashlib.blake2b(read_key(item).encode(), digest_size=16).digest(), dtype=np.uint64)
        if item.type == LoadItemType.BYTE_IO:
            info = (md.storage_data or {}).get(item.storage_index)
            sizes[i] = int(getattr(info, "length", 0))
        else:
            dtype = md.state_dict_metadata[item.storage_index.fqn].properties.dtype
            if dtype not in itemsize:
                itemsize[dtype] = dtype.itemsize
            sizes[i] = math.prod(item.lengths) * itemsize[dtype]
    return keys, sizes


def local_summary(reads: list[ReadItem], md: Metadata, mode: ReadOnceMode) -> ReadSummary:
    """What one loading rank tells the coordinator for read-once: its global rank, its host and
    the keys and sizes of its reads (no read items)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if mode == "off":
        return ReadSummary(rank, mode)
    keys, sizes = read_summary(reads, md)
    return ReadSummary(rank, mode, keys, sizes, os.environ.get("UCP_DCP_HOST") or socket.gethostname())


def plan_transport(summaries: list[ReadSummary | None]) -> list[TransportPlan]:
    """The coordinator's answer to every rank's :func:`local_summary`: per rank, what it sends and
    receives (global ranks), and, for all, the ranks that exchange (None if nobody does: then no
    side group is created)."""
    if not summaries or any(s is None or s.mode == "off" or s.keys is None for s in summaries):
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
