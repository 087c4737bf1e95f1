"""Reading byte ranges of checkpoint files: preads that finish short reads, page-cache mappings of
bounded windows, and gathering equal-length runs out of read intervals."""

from __future__ import annotations

import bisect
import io
import mmap
import os
import stat
from typing import Any

import numpy as np

__all__ = ["WINDOW", "gather_runs", "readinto", "regular_fd", "map_window"]


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
