"""Cold reads in the benchmarks: evict a checkpoint's files from the page cache, so that the next read
comes from the disk (``recipes/benchmark.py``, ``bench_single.py``, ``bench_trust.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def _files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for p in map(Path, items):
        out += [f for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else [p]
    return out


def evict(paths: str | Path | Iterable[str | Path]) -> None:
    """Drop the cached pages of ``paths`` (files, or folders: every file under them). Each file is
    ``fsync``-ed first: the kernel keeps dirty pages, so a just-written file would stay cached."""
    for f in _files(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
