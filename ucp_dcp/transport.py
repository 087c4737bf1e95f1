"""Carry bytes read by one rank to the other ranks that need the same saved bytes.

The coordinator's load plan names, for every piece of storage several ranks need, one reader; the
reader sends the piece to the others after its own reads. Messages go point to point on the
default group (global ranks), one per (reader, consumer) pair: an int64 header ``(status, nbytes)``
then the payload. A reader that failed (e.g. a checksum mismatch) still sends its headers with
``status = 1``, so no consumer waits forever; every rank raises after the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import UCPError

__all__ = ["assign_readers", "exchange"]


BUNDLE = 16 << 20
"""Shared pieces with the same holders travel in bundles of up to this many bytes, each with one
reader: a job's replicated scalars become one message per consumer, not one per scalar, while
large replicated tensors still spread over several readers."""


def assign_readers(keys_by_rank: Sequence[np.ndarray], sizes_by_rank: Sequence[np.ndarray],
                   bundle_bytes: int = BUNDLE) -> list[dict]:
    """For pieces needed by several ranks, pick one reader each. ``keys_by_rank[r]`` are 128-bit
    keys (``(n, 2)`` uint64) of rank r's pieces, ``sizes_by_rank[r]`` their byte sizes.

    Pieces with the same holders are grouped into bundles (at most ``bundle_bytes``, or one piece);
    each bundle, largest first, goes to the holder with the fewest bytes assigned so far (counting
    what it reads for itself), which spreads reads over ranks and hence files.

    Returns, per rank, ``{"send": [(pieces, dsts)], "recv": {src: pieces}}``: pieces are indices
    into that rank's own key array (nothing but indices travels back), ``dsts`` the consumers of a
    bundle (a rank holding the same bytes twice appears twice). A reader's message to ``dst`` is
    its bundles in list order, each once per occurrence of ``dst``; ``recv[src]`` lists the pieces
    in that order. Plan size is O(pieces + holders) per bundle, not O(pieces x holders)."""
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
            if cur and (g is None or cur_bytes + int(sizes[g[0]]) > bundle_bytes):
                bundles.append((cur_bytes, holders, np.stack(cur)))
                cur, cur_bytes = [], 0
            if g is not None:
                cur.append(g)
                cur_bytes += int(sizes[g[0]])
    bundles.sort(key=lambda b: -b[0])
    for nbytes, holders, entries in bundles:
        col = int(np.argmin(load[holders]))
        reader = int(holders[col])
        load[reader] += nbytes
        dsts, cols = [], []
        for h, r in enumerate(holders.tolist()):
            if r == reader:  # the reader's own copies (tied weights): its chunk reads serve them all
                continue
            dsts.append(r)
            cols.append(h)
            out[r]["recv"].setdefault(reader, []).append(local[entries[:, h]])
        if dsts:
            out[reader]["send"].append((local[entries[:, col]], np.array(dsts, dtype=np.int64)))
    for plan in out:
        plan["recv"] = {src: np.concatenate(parts) for src, parts in plan["recv"].items()}
    return out


def exchange(
    sends: dict[int, list[Any]],
    recvs: dict[int, list[int]],
    ok: bool,
) -> tuple[dict[int, list[memoryview]], list[int]]:
    """Send ``sends[dst]`` (byte buffers, concatenated) to every ``dst`` and receive ``recvs[src]``
    (piece sizes) from every ``src``. Returns the received pieces per source and the sources that
    reported a failure. ``ok=False`` sends failure headers instead of data."""
    works = []
    keep = []
    joined: dict[tuple[int, ...], torch.Tensor] = {}  # many consumers get the same bundles: build once
    for dst in sorted(sends):
        data = None
        if ok:
            parts = sends[dst]
            ident = tuple(id(p) for p in parts)
            data = joined.get(ident)
            if data is None:
                data = joined[ident] = _as_bytes_tensor(parts)
        header = torch.tensor([0 if ok else 1, data.numel() if data is not None else 0], dtype=torch.int64)
        keep.append(header)
        works.append(dist.isend(header, dst))
        if data is not None and data.numel():
            works.append(dist.isend(data, dst))
    received: dict[int, list[memoryview]] = {}
    failed: list[int] = []
    bad_size = []
    for src in sorted(recvs):
        header = torch.empty(2, dtype=torch.int64)
        dist.irecv(header, src).wait()
        status, nbytes = (int(x) for x in header)
        if status != 0:
            failed.append(src)
            continue
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:  # drain the payload even when it is unusable: the sender waits for it
            dist.irecv(buf, src).wait()
        expect = sum(recvs[src])
        if nbytes != expect:
            bad_size.append((src, nbytes, expect))
            continue
        mv = memoryview(buf.numpy())
        pieces, pos = [], 0
        for size in recvs[src]:
            pieces.append(mv[pos:pos + size])
            pos += size
        received[src] = pieces
    for w in works:
        w.wait()
    if bad_size:
        src, got, expect = bad_size[0]
        raise UCPError(f"rank {src} sent {got} bytes of shared checkpoint data, expected {expect}",
                       hint="the ranks disagree on the load plan; this is a bug, please report it")
    return received, failed


def _as_bytes_tensor(parts: Sequence[Any]) -> torch.Tensor:
    """One uint8 tensor holding ``parts`` back to back (no copy for a single writable buffer)."""
    if len(parts) == 1 and isinstance(parts[0], bytearray):
        return torch.frombuffer(parts[0], dtype=torch.uint8) if len(parts[0]) else torch.empty(0, dtype=torch.uint8)
    total = sum(memoryview(p).nbytes for p in parts)
    out = torch.empty(total, dtype=torch.uint8)
    dst = memoryview(out.numpy())
    pos = 0
    for p in parts:
        mv = memoryview(p).cast("B")
        dst[pos:pos + len(mv)] = mv
        pos += len(mv)
    return out
