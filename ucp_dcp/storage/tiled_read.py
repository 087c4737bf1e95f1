"""Strided boxes verified by tile checksums (:mod:`ucp_dcp.storage.tiles`), from a local file or an object.

A box that takes whole dims >= 2 of a chunk with tile sums is read one window of tile rows at a time:
the window's tiles the box touches are verified (each tile once per chunk, however many boxes share
it), then the box's runs in those rows are copied out with one strided copy. Bytes read are the touched
tiles' bytes: the box itself when its dim-1 edges fall on band edges.

A local file is mapped (:func:`read_tiled`: the page cache holds whole rows, only touched pages are
read). An object on a store is fetched as ranged GETs of the touched bands of each row
(:func:`read_tiled_remote`), joined across gaps only within :data:`~ucp_dcp.storage.file_ranges.REMOTE_WASTE`,
all of a window's in flight at once: a column slice of a row-sharded chunk costs one request per row
when its rows are narrow, and the bytes fetched are the slice's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import TruncatedFileError
from .file_ranges import WINDOW, coalesce_within, map_window
from .format import box_grid, gather_grid
from .tiles import TileGrid, TileRegion, region_tile_sums, tile_region

__all__ = ["TiledBox", "plan_tiled", "read_tiled", "read_tiled_remote", "remote_windows"]


@dataclass(frozen=True)
class TiledBox:
    """One box of a chunk and the tiles it touches."""

    offsets: tuple[int, ...]
    """Box offsets within the chunk."""
    sizes: tuple[int, ...]
    """Box sizes."""
    region: TileRegion
    """Tiles the box touches."""


def plan_tiled(
    grid: TileGrid, shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
) -> list[TiledBox] | None:
    """The boxes with their tiles, or None when one of them cannot be verified by tiles."""
    out = []
    for offsets, sizes in boxes:
        region = tile_region(grid, shape, offsets, sizes)
        if region is None:
            return None
        out.append(TiledBox(tuple(offsets), tuple(sizes), region))
    return out


def read_tiled(
    fd: int,
    base: int,
    shape: Sequence[int],
    itemsize: int,
    grid: TileGrid,
    box: TiledBox,
    out: np.ndarray,
    verified: set[int],
    check: Callable[[int, int], None],
    algo: Callable[[], object],
) -> int:
    """Copy ``box`` of the chunk whose data starts at file offset ``base`` into ``out`` (uint8, the
    box's bytes in row-major order), verifying every tile it touches that is not in ``verified``
    (``check(tile, checksum)`` raises on a mismatch). Returns the bytes of the tiles verified now."""
    row_bytes = grid.row_bytes
    step = max(1, WINDOW // (grid.rows_per_tile * row_bytes))  # tile rows per mapped window
    r_first, r_end = box.offsets[0], box.offsets[0] + box.sizes[0]
    box_row = out.nbytes // box.sizes[0] if box.sizes[0] else 0
    read = 0
    for g in range(box.region.g0, box.region.g1, step):
        part = TileRegion(g, min(box.region.g1, g + step), box.region.b0, box.region.b1)
        w0, w1 = part.row_span(grid)
        window = map_window(fd, base + w0 * row_bytes, (w1 - w0) * row_bytes)
        new = (
            [(t, s) for t, s in region_tile_sums(window, grid, part, algo) if t not in verified]
            if _unverified(grid, part, verified)
            else []
        )
        for t, s in new:
            check(t, s)
            verified.add(t)
        read += len(new) * grid.band_bytes * grid.rows_per_tile - _short_last(grid, part, new)
        a, b = max(r_first, w0), min(r_end, w1)
        if a < b:
            offs = (a - w0, *box.offsets[1:])
            sizes = (b - a, *box.sizes[1:])
            sub = box_grid((w1 - w0, *shape[1:]), itemsize, offs, sizes)
            gather_grid(window, 0, sub, out[(a - r_first) * box_row : (b - r_first) * box_row])
        del window
    return read


def read_tiled_remote(
    fetch: Callable[[list[tuple[int, int]]], list[bytes]],
    base: int,
    shape: Sequence[int],
    itemsize: int,
    grid: TileGrid,
    box: TiledBox,
    out: np.ndarray,
    verified: set[int],
    check: Callable[[int, int], None],
    algo: Callable[[], object],
    gap: int = 0,
) -> tuple[int, int]:
    """:func:`read_tiled` for an object on a store: ``fetch(ranges)`` returns the bytes of ``(start, length)``
    ranges of the object (fetched concurrently). Only the bands of the box's tiles are fetched, row by row
    (``gap``: gaps up to this size between rows fetched too). Returns ``(bytes fetched, requests)``."""
    r = box.region
    nb, band, row_bytes = r.b1 - r.b0, grid.band_bytes, grid.row_bytes
    run = nb * band  # the touched bands of one row: contiguous in the object
    per_band = grid.cols // grid.bands
    r_first, r_end = box.offsets[0], box.offsets[0] + box.sizes[0]
    box_row = out.nbytes // box.sizes[0] if box.sizes[0] else 0
    fetched = requests = 0
    for part, ranges in remote_windows(base, grid, box, gap):
        w0, w1 = part.row_span(grid)
        rows = np.empty((w1 - w0, run), dtype=np.uint8)
        k = 0
        for (s, n), data in zip(ranges, fetch(ranges)):
            if len(data) != n:
                raise TruncatedFileError(f"the object ended at {s + len(data)}, before {s + n}")
            m = (n - run) // row_bytes + 1  # rows this range holds (a joined range spans their gaps)
            src = np.frombuffer(data, dtype=np.uint8)
            rows[k : k + m] = np.lib.stride_tricks.as_strided(
                src, shape=(m, run), strides=(row_bytes, 1), writeable=False
            )
            k += m
        fetched += sum(n for _, n in ranges)
        requests += len(ranges)
        for t, got in _band_tile_sums(rows.reshape(w1 - w0, nb, band), grid, part, w0, algo):
            if t not in verified:
                check(t, got)
                verified.add(t)
        a, b = max(r_first, w0), min(r_end, w1)
        if a < b:
            offs = (a - w0, box.offsets[1] - r.b0 * per_band, *box.offsets[2:])
            sizes = (b - a, *box.sizes[1:])
            sub = box_grid((w1 - w0, nb * per_band, *shape[2:]), itemsize, offs, sizes)
            gather_grid(rows.reshape(-1), 0, sub, out[(a - r_first) * box_row : (b - r_first) * box_row])
    return fetched, requests


def remote_windows(
    base: int, grid: TileGrid, box: TiledBox, gap: int = 0
) -> Iterator[tuple[TileRegion, list[tuple[int, int]]]]:
    """The windows of tile rows :func:`read_tiled_remote` fetches in turn for ``box``, each with its ranges:
    the touched bands of every row, joined across gaps up to ``gap`` and within
    :data:`~ucp_dcp.storage.file_ranges.REMOTE_WASTE`
    (``ucp_dcp plan`` counts these requests without fetching them)."""
    r = box.region
    run = (r.b1 - r.b0) * grid.band_bytes
    step = max(1, WINDOW // (grid.rows_per_tile * run))  # tile rows per window
    for g in range(r.g0, r.g1, step):
        part = TileRegion(g, min(r.g1, g + step), r.b0, r.b1)
        w0, w1 = part.row_span(grid)
        first = base + w0 * grid.row_bytes + r.b0 * grid.band_bytes
        yield part, coalesce_within([(first + k * grid.row_bytes, run) for k in range(w1 - w0)], gap=gap)


def _band_tile_sums(
    bands: np.ndarray, grid: TileGrid, part: TileRegion, r0: int, algo: Callable[[], object]
) -> list[tuple[int, int]]:
    """``(tile, checksum)`` of the tiles of ``part`` from ``bands``: rows ``r0..`` of the chunk, only the
    part's bands of each (shape ``(rows, bands of the part, band bytes)``)."""
    out: list[tuple[int, int]] = []
    for g in range(part.g0, part.g1):
        a, b = g * grid.rows_per_tile - r0, min(grid.rows, (g + 1) * grid.rows_per_tile) - r0
        tiles = np.ascontiguousarray(bands[a:b].transpose(1, 0, 2))
        for k in range(part.b1 - part.b0):
            h = algo()
            h.update(tiles[k])  # type: ignore[attr-defined]
            out.append((g * grid.bands + part.b0 + k, int(h.intdigest())))  # type: ignore[attr-defined]
    return out


def _unverified(grid: TileGrid, part: TileRegion, verified: set[int]) -> bool:
    return any(g * grid.bands + b not in verified for g in range(part.g0, part.g1) for b in range(part.b0, part.b1))


def _short_last(grid: TileGrid, part: TileRegion, new: list[tuple[int, int]]) -> int:
    """Bytes the last tile row lacks (it may hold fewer rows), for the tiles verified now."""
    last = grid.groups - 1
    missing = (last + 1) * grid.rows_per_tile - grid.rows
    if not missing:
        return 0
    return sum(missing * grid.band_bytes for t, _ in new if t // grid.bands == last)
