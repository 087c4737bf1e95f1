"""Carry bytes read by one rank to the other ranks that need the same saved bytes.

The coordinator's load plan names, for every piece of storage several ranks need, one reader; the
reader sends the piece to the others after its own reads. Pieces travel in *bundles*: a piece of
at least ``SOLO`` bytes alone (sent from, and received into, tensor memory: no copy on either
side), smaller pieces with the same holders packed up to ``BUNDLE`` bytes. Each bundle is one
point-to-point message per consumer on the default group (global ranks): an int64 header
``(status, nbytes)`` then the payload, tagged by its position among the pair's messages. A reader
that failed (e.g. a checksum mismatch) still sends every header, with ``status = 1``, so no
consumer waits forever; every rank raises after the exchange. A consumer receives one bundle at a
time, so its extra memory is one packed bundle at most.

Messages are host bytes. They travel on the default group when it carries CPU tensors (``gloo``,
``cpu:gloo,cuda:nccl``); under a default group that does not (NCCL only, as torchtitan sets up on
GPUs) on one gloo side group over the load's ranks, created on first use and reused
(:func:`p2p_group`). ``UCP_DCP_P2P=side`` forces the side group (tests on gloo).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import os

import numpy as np
import torch
import torch.distributed as dist

from ._compat import default_group
from .errors import UCPError

__all__ = ["BUNDLE", "SOLO", "P2P_ENV", "Incoming", "assign_readers", "exchange", "as_bytes_tensor", "carries_cpu",
           "p2p_group", "send_device"]

P2P_ENV = "UCP_DCP_P2P"
"""``side``: send host bytes on the gloo side group even when the default group could carry them."""


BUNDLE = 16 << 20
"""Small shared pieces with the same holders are packed into bundles of up to this many bytes, each
with one reader: a job's replicated scalars become one message per consumer, not one per scalar."""
SOLO = 1 << 20
"""A shared piece of at least this many bytes is a bundle of its own (sent zero-copy)."""


def assign_readers(keys_by_rank: Sequence[np.ndarray], sizes_by_rank: Sequence[np.ndarray],
                   bundle_bytes: int = BUNDLE, solo_bytes: int = SOLO, hosts: np.ndarray | None = None) -> list[dict]:
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
    idx = np.nonzero(shared)[0]
    order = idx[np.lexsort((local[idx], owner[idx], inverse[idx]))]
    starts = np.flatnonzero(np.diff(inverse[order], prepend=-1))
    # class the shared pieces by their holders (exact: the holder list's bytes)
    classes: dict[bytes, list[np.ndarray]] = {}
    for g in np.split(order, starts[1:]):
        classes.setdefault(owner[g].tobytes(), []).append(g)
    bundles: list[tuple[int, np.ndarray, np.ndarray]] = []  # (bytes, holders, entries: pieces x holders)
    for sig in sorted(classes):
        groups = sorted(classes[sig], key=lambda g: (-int(sizes[g[0]]), int(inverse[g[0]])))
        holders = np.frombuffer(sig, dtype=owner.dtype)
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
    bundles.sort(key=lambda b: -b[0])
    for nbytes, holders, entries in bundles:
        col = int(np.argmin(load[holders]))
        reader = int(holders[col])
        load[reader] += nbytes
        dsts, cols = [], []
        for h, r in enumerate(holders.tolist()):
            if r == reader:  # the reader's own copies (tied weights): its chunk reads serve them all
                continue
            if hosts is not None and hosts[r] == hosts[reader]:
                continue  # same host: reading is a page-cache hit once the reader has read it
            dsts.append(r)
            cols.append(h)
            out[r]["recv"].setdefault(reader, []).append(local[entries[:, h]])
        if dsts:
            out[reader]["send"].append((local[entries[:, col]], np.array(dsts, dtype=np.int64)))
    return out


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


def carries_cpu(backend: str) -> bool:
    """Whether a process group with this backend string (``dist.get_backend()``: ``gloo``,
    ``nccl``, ``cpu:gloo,cuda:nccl``, ...) can send CPU tensors."""
    backend = backend.lower()
    if ":" in backend:  # a device -> backend map
        return any(part.split(":", 1)[0].strip() == "cpu" for part in backend.split(","))
    return backend not in ("nccl", "xccl", "hccl")


_SIDE: dict[tuple[int, tuple[int, ...] | None], dist.ProcessGroup] = {}


def p2p_group(ranks: list[int] | None = None) -> dist.ProcessGroup | None:
    """The group for host-byte messages among ``ranks`` (global ranks; None: the whole world):
    None (the default group) when it carries CPU tensors, else one gloo group, created once per
    default group and member set. Every member must call this in the same order (group creation
    synchronizes the members)."""
    if carries_cpu(str(dist.get_backend())) and os.environ.get(P2P_ENV, "default") != "side":
        return None
    members = tuple(sorted(ranks)) if ranks is not None else None
    key = (id(default_group()), members)
    if key not in _SIDE:
        _SIDE[key] = dist.new_group(ranks=list(members) if members is not None else None, backend="gloo",
                                    use_local_synchronization=members is not None)
    return _SIDE[key]


def send_device(t: torch.Tensor) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Where a tensor travels for a point-to-point exchange among all ranks: device tensors over the
    default group when it has a backend for their device (NCCL for CUDA), everything else as host
    tensors over :func:`p2p_group`. Returns ``(device to send from, group)``."""
    if t.device.type != "cpu":
        backend = str(dist.get_backend()).lower()
        if t.device.type == "cuda" and ("nccl" in backend):
            return t.device, None
    return torch.device("cpu"), p2p_group()


def exchange(sends: dict[int, list[torch.Tensor | None]], recvs: dict[int, list[Incoming]], ok: bool,
             group: dist.ProcessGroup | None = None) -> list[int]:
    """Send every ``sends[dst]`` message (uint8 tensors, in order) and receive every ``recvs[src]``
    message (in order), delivering each as it arrives, on ``group`` (None: the default group;
    ranks are global). Returns the sources that reported a failure. ``ok=False`` sends failure
    headers instead of data (payloads may then be None)."""
    works, keep = [], []
    for dst in sorted(sends):
        for k, data in enumerate(sends[dst]):
            header = torch.tensor([0 if ok else 1, data.numel() if ok and data is not None else 0], dtype=torch.int64)
            keep.append(header)
            works.append(dist.isend(header, dst, group=group, tag=2 * k))
            if ok and data is not None and data.numel():
                works.append(dist.isend(data, dst, group=group, tag=2 * k + 1))
    failed: list[int] = []
    bad_size = []
    for src in sorted(recvs):
        for k, msg in enumerate(recvs[src]):
            header = torch.empty(2, dtype=torch.int64)
            dist.irecv(header, src, group=group, tag=2 * k).wait()
            status, nbytes = (int(x) for x in header)
            if status != 0:
                if src not in failed:
                    failed.append(src)
                continue
            if nbytes != msg.nbytes:  # drain the payload even when it is unusable: the sender waits for it
                if nbytes:
                    dist.irecv(torch.empty(nbytes, dtype=torch.uint8), src, group=group, tag=2 * k + 1).wait()
                bad_size.append((src, nbytes, msg.nbytes))
                continue
            buf = msg.buffer() if nbytes else torch.empty(0, dtype=torch.uint8)
            if nbytes:
                dist.irecv(buf, src, group=group, tag=2 * k + 1).wait()
            msg.deliver(buf)
    for w in works:
        w.wait()
    if bad_size:
        src, got, expect = bad_size[0]
        raise UCPError(f"rank {src} sent {got} bytes of shared checkpoint data, expected {expect}",
                       hint="the ranks disagree on the load plan; this is a bug, please report it")
    return failed


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
        dst[pos:pos + len(mv)] = mv
        pos += len(mv)
    return out
