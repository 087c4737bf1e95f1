"""How many threads a rank reads with, and how its reads are cut into work for them.

One thread reading one file is far from what a machine moves: on the H100 machine (16 cores) page
cache -> pinned -> device ran at 4.7 GB/s with one thread and 28.9 GB/s with sixteen (issue 25). A
rank therefore reads with the cores it may use, shared with the other ranks of its host, and a file
holding many chunks (one file per rank is DCP's and ucp_dcp's default) is cut into runs of whole
chunks so that those threads all have work. Pure functions; the reader calls them per load.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from .. import settings

__all__ = ["MAX_THREADS", "MIN_THREADS", "STORE_REQUESTS_PER_THREAD", "reading_threads", "split_work"]

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
