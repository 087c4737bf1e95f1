"""Reading byte ranges of checkpoint files: preads that finish short reads, page-cache mappings of
bounded windows, gathering equal-length runs out of read intervals, and joining the ranges of a remote
file into fewer requests within a byte budget; then how many threads a rank reads (and writes) with, and
how its reads are cut into work for them."""

from __future__ import annotations

import bisect
import io
import mmap
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

from .. import settings

__all__ = [
    "REMOTE_GAP",
    "REMOTE_WASTE",
    "StoreRanges",
    "WINDOW",
    "coalesce_within",
    "gather_runs",
    "readinto",
    "regular_fd",
    "map_window",
    "MAX_THREADS",
    "MIN_THREADS",
    "STORE_REQUESTS_PER_THREAD",
    "reading_threads",
    "split_work",
]

REMOTE_WASTE = 0.02
"""Bytes a remote (object-store) read may fetch beyond those it needs, as a share of them: ranges of one
file are joined across their gaps, smallest gaps first, while the gaps fetched stay within this share.
Fewer requests, each a round trip, at a bounded cost in bytes: 2 %, leaving room under the 1.05 bound on
bytes read / needed for the records' framing around small items read whole."""


REMOTE_GAP = 1 << 20
"""``store_ranges="few"``: gaps up to this size are fetched too (on a store a request costs a round trip and
a share of the prefix's request rate, worth about this many bytes of transfer)."""

StoreRanges = Literal["few", "exact"]
"""How a reader on an object store cuts strided reads into ranged GETs: ``"few"``, gaps under
:data:`REMOTE_GAP` fetched too (a column slice of narrow rows reads whole rows: a few requests, up to the
whole rows' bytes); ``"exact"``, the bytes needed (gaps joined within :data:`REMOTE_WASTE`: a request per
run otherwise, e.g. one per saved row of a column slice)."""


def coalesce_within(
    intervals: list[tuple[int, int]], waste: float = REMOTE_WASTE, gap: int = 0
) -> list[tuple[int, int]]:
    """``(start, length)`` intervals, sorted and disjoint, with every gap of at most ``gap`` bytes joined,
    and the smallest of the others while the joined gap bytes stay within ``waste`` times the intervals'
    bytes."""
    if len(intervals) < 2:
        return list(intervals)
    arr = np.asarray(intervals, dtype=np.int64)
    gaps = arr[1:, 0] - (arr[:-1, 0] + arr[:-1, 1])
    budget = waste * float(arr[:, 1].sum())
    order = np.argsort(gaps, kind="stable")
    within = np.cumsum(gaps[order]) <= budget
    join = gaps <= gap
    join[order[within]] = True  # gap i joins interval i and i + 1
    out: list[tuple[int, int]] = []
    for k, (s, n) in enumerate(arr.tolist()):
        if k and join[k - 1]:
            out[-1] = (out[-1][0], s + n - out[-1][0])
        else:
            out.append((s, n))
    return out


def gather_runs(buffers: list[tuple[int, memoryview]], bstarts: list[int], starts: np.ndarray, run: int) -> memoryview:
    """The runs ``starts`` (each ``run`` bytes), concatenated, from the merged interval buffers."""
    if len(starts) == 1:
        k = bisect.bisect_right(bstarts, int(starts[0])) - 1
        s0, buf = buffers[k]
        return buf[int(starts[0]) - s0 : int(starts[0]) - s0 + run]
    out = bytearray(run * len(starts))
    mv = memoryview(out)
    pos = 0
    for s in starts.tolist():
        k = bisect.bisect_right(bstarts, s) - 1
        s0, buf = buffers[k]
        mv[pos : pos + run] = buf[s - s0 : s - s0 + run]
        pos += run
    return mv


def readinto(f: Any, out: memoryview) -> int:
    data = f.read(len(out))
    out[: len(data)] = data
    return len(data)


WINDOW = 8 << 20
"""Most bytes of a chunk mapped at once by a strided read (bounds the page-cache pages mapped)."""


def regular_fd(f: Any) -> int | None:
    """The descriptor of ``f`` if it is a local regular file (mappable), else None."""
    try:
        fd = f.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None


def map_window(fd: int, offset: int, length: int) -> np.ndarray:
    """Read-only uint8 view of file bytes ``[offset, offset + length)`` (the caller checked the
    file is long enough: touching a mapping past the end of a file is SIGBUS, not an error)."""
    if length <= 0:
        return np.empty(0, dtype=np.uint8)
    a = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, offset + length - a, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ, offset=a)
    return np.frombuffer(mm, dtype=np.uint8)[offset - a :]


# -- how many threads a rank reads with, and how its reads are cut into work for them ------------------------------
# How many threads a rank reads with, and how its reads are cut into work for them.
#
# One thread reading one file is far from what a machine moves: on the H100 machine (16 cores) page
# cache -> pinned -> device ran at 4.7 GB/s with one thread and 28.9 GB/s with sixteen (issue 25). A
# rank therefore reads with the cores it may use, shared with the other ranks of its host, and a file
# holding many chunks (one file per rank is DCP's and ucp_dcp's default) is cut into runs of whole
# chunks so that those threads all have work. Pure functions; the reader calls them per load.
MAX_THREADS = 16
"""Most reading threads per rank (16 saturated the H100 machine's page cache -> device pipeline)."""
MIN_THREADS = 2
"""Fewest reading threads per rank (one waits on storage while another copies)."""

STORE_REQUESTS_PER_THREAD = 4
"""Reading threads per local one when the checkpoint is on an object store: each waits on a request's
round trip rather than on a core, so a rank keeps several ranged GETs in flight per core it may use."""

T = TypeVar("T")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def reading_threads(cores: int | None = None, local_ranks: int | None = None) -> int:
    """Reading threads for one rank: the cores this process may use (``sched_getaffinity``) divided
    among the ranks of its host (``$LOCAL_WORLD_SIZE``, set by torchrun), within
    [:data:`MIN_THREADS`, :data:`MAX_THREADS`]."""
    cores = _cores() if cores is None else cores
    if local_ranks is None:
        local_ranks = settings.local_world_size()
    return max(MIN_THREADS, min(MAX_THREADS, cores // max(1, local_ranks)))


def split_work(
    files: Sequence[tuple[str, Sequence[T]]], threads: int, nbytes: Callable[[T], int]
) -> list[tuple[str, list[T]]]:
    """Cut ``files`` (file, its chunks in offset order) into at least ``threads`` tasks where the
    chunks allow: a file whose bytes exceed a fair share (total / threads) becomes consecutive runs of
    whole chunks of about that share each, in order; smaller files stay one task. Every chunk is in
    exactly one task, and each task's chunks keep their order (reads stay sequential in a file)."""
    total = sum(nbytes(c) for _, cs in files for c in cs)
    if threads <= 1 or total == 0:
        return [(rel, list(cs)) for rel, cs in files if cs]
    share = max(1, -(-total // threads))
    out: list[tuple[str, list[T]]] = []
    for rel, cs in files:
        run: list[T] = []
        size = 0
        for c in cs:
            if run and size + nbytes(c) > share:
                out.append((rel, run))
                run, size = [], 0
            run.append(c)
            size += nbytes(c)
        if run:
            out.append((rel, run))
    return out
