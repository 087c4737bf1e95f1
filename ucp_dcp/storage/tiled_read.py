"""Strided boxes of a local file verified by tile checksums (:mod:`ucp_dcp.storage.tiles`).

A box that takes whole dims >= 2 of a chunk with tile sums is read one window of tile rows at a time:
the window's tiles the box touches are verified from the mapping (each tile once per chunk, however
many boxes share it), then the box's runs in those rows are copied out with one strided copy. Bytes
read are the touched tiles' bytes: the box itself when its dim-1 edges fall on band edges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .file_ranges import WINDOW, map_window
from .format import box_grid, gather_grid
from .tiles import TileGrid, TileRegion, region_tile_sums, tile_region

__all__ = ["TiledBox", "plan_tiled", "read_tiled"]


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


def _unverified(grid: TileGrid, part: TileRegion, verified: set[int]) -> bool:
    return any(g * grid.bands + b not in verified for g in range(part.g0, part.g1) for b in range(part.b0, part.b1))


def _short_last(grid: TileGrid, part: TileRegion, new: list[tuple[int, int]]) -> int:
    """Bytes the last tile row lacks (it may hold fewer rows), for the tiles verified now."""
    last = grid.groups - 1
    missing = (last + 1) * grid.rows_per_tile - grid.rows
    if not missing:
        return 0
    return sum(missing * grid.band_bytes for t, _ in new if t // grid.bands == last)
