"""Carry bytes read by one rank to the other ranks that need the same saved bytes.

The coordinator's load plan names, for every piece of storage several ranks need, one reader; the
reader sends the piece to the others after its own reads. Messages go point to point on the
default group (global ranks), one per (reader, consumer) pair: an int64 header ``(status, nbytes)``
then the payload. A reader that failed (e.g. a checksum mismatch) still sends its headers with
``status = 1``, so no consumer waits forever; every rank raises after the exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .errors import UCPError

__all__ = ["assign_readers", "exchange"]


def assign_readers(keys_by_rank: Sequence[np.ndarray], sizes_by_rank: Sequence[np.ndarray]) -> list[dict]:
    """For pieces needed by several ranks, pick one reader each (the holder with the fewest bytes
    assigned so far: spreads reads over ranks and hence files). ``keys_by_rank[r]`` are 128-bit keys
    (``(n, 2)`` uint64) of rank r's pieces, ``sizes_by_rank[r]`` their byte sizes.

    Returns, per rank, ``{"send": {rank: [piece]}, "recv": {rank: [piece]}}`` where a piece is the
    index into that rank's own key array (so nothing but indices travels back)."""
    n = len(keys_by_rank)
    out: list[dict] = [{"send": {}, "recv": {}} for _ in range(n)]
    counts = [len(k) for k in keys_by_rank]
    if sum(counts) == 0:
        return out
    keys = np.concatenate([k.reshape(-1, 2) for k in keys_by_rank]).view(np.dtype((np.void, 16))).reshape(-1)
    sizes = np.concatenate(sizes_by_rank)
    owner = np.repeat(np.arange(n), counts)
    local = np.concatenate([np.arange(c) for c in counts])
    uniq, inverse, cnt = np.unique(keys, return_inverse=True, return_counts=True)
    shared = cnt[inverse] > 1
    if not shared.any():
        return out
    load = np.zeros(n, dtype=np.int64)
    # every rank reads its unshared pieces itself: count them first so shared ones go elsewhere
    np.add.at(load, owner[~shared], sizes[~shared])
    idx = np.nonzero(shared)[0]
    order = idx[np.lexsort((owner[idx], inverse[idx]))]
    groups = np.split(order, np.nonzero(np.diff(inverse[order]))[0] + 1)
    for g in sorted(groups, key=lambda g: (-int(sizes[g[0]]), int(inverse[g[0]]))):
        holders = owner[g]
        reader_pos = int(np.argmin(load[holders]))
        reader = int(holders[reader_pos])
        load[reader] += int(sizes[g[0]])
        for pos, (r, li) in enumerate(zip(holders.tolist(), local[g].tolist())):
            if r == reader:  # the reader's own copies (tied weights): its chunk reads serve them all
                continue
            out[reader]["send"].setdefault(r, []).append(int(local[g[reader_pos]]))
            out[r]["recv"].setdefault(reader, []).append(li)
    return out


def exchange(
    sends: dict[int, list[bytes | memoryview | bytearray]],
    recvs: dict[int, list[int]],
    ok: bool,
) -> tuple[dict[int, list[memoryview]], list[int]]:
    """Send ``sends[dst]`` (pieces, concatenated) to every ``dst`` and receive ``recvs[src]``
    (piece sizes) from every ``src``. Returns the received pieces per source and the sources that
    reported a failure. ``ok=False`` sends failure headers instead of data."""
    works = []
    keep = []
    for dst in sorted(sends):
        payload = b"".join(bytes(p) for p in sends[dst]) if ok else b""
        header = torch.tensor([0 if ok else 1, len(payload)], dtype=torch.int64)
        keep.append(header)
        works.append(dist.isend(header, dst))
        if ok and payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            keep.append(data)
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
