"""Who serves which fragment of a memory load: a rank whose host lacks a data file gets the boxes it
needs of that file from a rank on a host holding it (its own store's or a replica of a lost host's).

The coordinator gets every rank's requests (read items in files its host does not hold) in DCP's
``prepare_global_plan`` and gives each to the least-loaded rank of a holding host. Messages between a
pair are bundles in the read-once layout (:mod:`ucp_dcp.storage.transport`): a fragment of at least
``SOLO`` bytes alone, received straight into the target; smaller ones packed up to ``BUNDLE``.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..storage.transport import BUNDLE, SOLO

__all__ = ["ServeRequest", "ServePlan", "assign_servers", "ScratchPlanner"]


@dataclass(frozen=True)
class ServeRequest:
    """One loading rank's fragments in files its host does not hold (``LoadPlan.storage_data``)."""

    rank: int
    """Global rank."""
    items: list[ReadItem] = field(default_factory=list)
    """The read items (the server reads exactly these boxes)."""
    positions: list[int] = field(default_factory=list)
    """Their positions in this rank's plan."""
    files: list[str] = field(default_factory=list)
    """The data file each item is in."""
    sizes: list[int] = field(default_factory=list)
    """Bytes of each item."""


@dataclass(frozen=True)
class ServePlan:
    """The coordinator's answer to one rank (``LoadPlan.storage_data``)."""

    serve: dict[int, list[list[ReadItem]]] = field(default_factory=dict)
    """``consumer global rank -> messages``: the items this rank reads for it, per message."""
    recv: dict[int, list[list[int]]] = field(default_factory=dict)
    """``server global rank -> messages``: positions of this rank's items, per message, in order."""
    members: list[int] = field(default_factory=list)
    """Every loading rank when some fragment crosses hosts (the exchange's watch gates them all), else empty."""
    served_bytes: int = 0
    """Bytes this rank receives from peers."""


def assign_servers(
    requests: list[ServeRequest], holders: dict[str, list[str]], rank_hosts: dict[int, str]
) -> list[ServePlan]:
    """A server per requested fragment: the rank on a host holding its file that has been given the
    fewest bytes so far (ties: the lowest rank). Returns one plan per request, in order."""
    load = dict.fromkeys(rank_hosts, 0)
    by_host: dict[str, list[int]] = {}
    for r, h in sorted(rank_hosts.items()):
        by_host.setdefault(h, []).append(r)
    pairs: dict[tuple[int, int], list[tuple[int, ReadItem, int]]] = {}
    for req in requests:
        for item, pos, name, size in zip(req.items, req.positions, req.files, req.sizes):
            cands = [r for h in holders.get(name, []) for r in by_host.get(h, [])]
            if not cands:  # the locate step guarantees a holder; a plan without one is a bug
                raise AssertionError(f"no loading rank holds {name}")
            server = min(cands, key=lambda r: (load[r], r))
            load[server] += size
            pairs.setdefault((server, req.rank), []).append((pos, item, size))
    # no fragment crosses hosts (every rank's host holds what it needs): no exchange, so no gates
    # or exchange group either (a failing read reaches every rank through DCP's gather of the results)
    members = sorted(rank_hosts) if pairs else []
    serve: dict[int, dict[int, list[list[ReadItem]]]] = {}
    recv: dict[int, dict[int, list[list[int]]]] = {}
    got: dict[int, int] = {}
    for (server, dst), entries in sorted(pairs.items()):
        for msg in _bundles(entries):
            serve.setdefault(server, {}).setdefault(dst, []).append([it for _, it, _ in msg])
            recv.setdefault(dst, {}).setdefault(server, []).append([p for p, _, _ in msg])
            got[dst] = got.get(dst, 0) + sum(n for _, _, n in msg)
    return [ServePlan(serve.get(q.rank, {}), recv.get(q.rank, {}), members, got.get(q.rank, 0)) for q in requests]


def _bundles(entries: list[tuple[int, ReadItem, int]]) -> list[list[tuple[int, ReadItem, int]]]:
    out: list[list[tuple[int, ReadItem, int]]] = []
    cur: list[tuple[int, ReadItem, int]] = []
    cur_bytes = 0
    for e in sorted(entries, key=lambda e: e[0]):
        if e[2] >= SOLO:
            out.append([e])
            continue
        if cur and cur_bytes + e[2] > BUNDLE:
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(e)
        cur_bytes += e[2]
    if cur:
        out.append(cur)
    return out


HUGE = 2 << 20
"""Scratch of at least this many bytes is backed by transparent huge pages where the kernel offers them."""


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for bytes that are read once and sent: large ones in anonymous memory
    advised to use huge pages (the fresh 4 KiB pages of a plain allocation, each faulted in by the read,
    cost more than the read from tmpfs itself: 2.4x the time for 16 MiB pieces on the 2-core VM)."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages
        pass
    return torch.frombuffer(m, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping


class ScratchPlanner:
    """The load planner a server reads others' fragments with: each box lands in a scratch tensor of
    the saved dtype (kept for sending); nothing is committed anywhere."""

    def __init__(self, chunk_meta: dict[Any, tuple[Any, tuple[int, ...]]]) -> None:
        self._meta = chunk_meta
        self._scratch: dict[int, Any] = {}

    def resolve_tensor(self, item: ReadItem) -> Any:
        t = self._scratch.get(id(item))
        if t is None:
            dtype, _ = self._meta[item.storage_index]
            t = self._scratch[id(item)] = scratch(tuple(int(x) for x in item.lengths), dtype)
        return t

    def commit_tensor(self, item: ReadItem, tensor: Any) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: Any) -> None:
        assert item.type == LoadItemType.BYTE_IO
