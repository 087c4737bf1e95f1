"""Tile checksums: verification whose granularity follows column reads.

A checksum block spans whole rows of a row-major chunk, so verifying a column slice (a tensor saved
sharded on dim 0 and loaded sharded on dim 1, "tp-dim") would read every row in full: 4x the bytes
at a degree of 4. A chunk of two or more dims therefore also records one checksum per *tile*:
``rows_per_tile`` consecutive dim-0 rows times one of ``bands`` equal slices of dim 1 (each band
holding whole sub-rows of the dims after it). A box that takes whole dims >= 2 touches whole tiles
when its dim-1 edges fall on band edges (``bands`` is the largest of 64, 32, ..., 2 dividing dim 1,
so every TP degree dividing it does), and verifying it reads only those tiles.

A tile's bytes are its rows' band bytes, concatenated in row order. Pure functions; the writer
computes the sums next to the block sums, the reader verifies the tiles a strided read touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CorruptCheckpointError

__all__ = [
    "TILE",
    "MAX_BANDS",
    "MIN_BAND",
    "TileGrid",
    "tile_grid",
    "tile_checksums",
    "tile_region",
    "TileRegion",
    "region_tile_sums",
    "saved_tile_grid",
    "tile_entry",
]

TILE = 256 << 10
"""Target bytes per tile (more tiles per chunk: finer row ranges, a longer I/O table)."""
MAX_BANDS = 64
"""Most bands per row: every TP degree dividing 64 (and dim 1) reads whole bands."""
MIN_BAND = 512
"""Fewest bytes per band (smaller runs cost more to hash and copy than to read whole)."""


@dataclass(frozen=True)
class TileGrid:
    """How a chunk's bytes are cut into tiles."""

    rows: int
    """Dim-0 size of the chunk."""
    cols: int
    """Dim-1 size of the chunk."""
    inner: int
    """Bytes of one dim-1 index (the product of the dims after it, times the item size)."""
    bands: int
    """Equal slices of dim 1 per row."""
    rows_per_tile: int
    """Dim-0 rows per tile (the last tile row may hold fewer)."""

    @property
    def band_bytes(self) -> int:
        return self.cols // self.bands * self.inner

    @property
    def row_bytes(self) -> int:
        return self.cols * self.inner

    @property
    def groups(self) -> int:
        """Tile rows: groups of ``rows_per_tile`` dim-0 rows."""
        return -(-self.rows // self.rows_per_tile)

    def to_json(self) -> list[int]:
        return [self.bands, self.rows_per_tile]


def tile_grid(shape: Sequence[int], itemsize: int, tile: int = TILE) -> TileGrid | None:
    """The tiles of a row-major chunk of ``shape``, or None when tiles would not narrow any read
    (fewer than two dims, an empty chunk, or no band split of dim 1 of at least ``MIN_BAND`` bytes)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    cols, inner = int(shape[1]), math.prod(shape[2:]) * itemsize
    bands = next(
        (b for b in (64, 32, 16, 8, 4, 2) if b <= MAX_BANDS and cols % b == 0 and cols // b * inner >= MIN_BAND), 1
    )
    if bands == 1:
        return None
    band_bytes = cols // bands * inner
    return TileGrid(int(shape[0]), cols, inner, bands, max(1, tile // band_bytes))


def _hash(data: np.ndarray, algo: Callable[[], object]) -> int:
    h = algo()
    h.update(data)  # type: ignore[attr-defined]
    return int(h.intdigest())  # type: ignore[attr-defined]


def tile_checksums(raw: memoryview | np.ndarray, grid: TileGrid, algo: Callable[[], object]) -> list[int]:
    """Checksum of every tile of a chunk's bytes ``raw``, tile row by tile row, band by band."""
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(grid.rows, grid.bands, grid.band_bytes)
    out: list[int] = []
    for g in range(grid.groups):
        r0, r1 = g * grid.rows_per_tile, min(grid.rows, (g + 1) * grid.rows_per_tile)
        bands = np.ascontiguousarray(arr[r0:r1].transpose(1, 0, 2))  # one copy per tile row: each tile contiguous
        out.extend(_hash(bands[b], algo) for b in range(grid.bands))
    return out


@dataclass(frozen=True)
class TileRegion:
    """The tiles a box touches: tile rows ``[g0, g1)`` times bands ``[b0, b1)``."""

    g0: int
    """First tile row."""
    g1: int
    """One past the last tile row."""
    b0: int
    """First band."""
    b1: int
    """One past the last band."""

    def row_span(self, grid: TileGrid) -> tuple[int, int]:
        """Dim-0 rows ``[r0, r1)`` these tiles cover."""
        return self.g0 * grid.rows_per_tile, min(grid.rows, self.g1 * grid.rows_per_tile)

    def nbytes(self, grid: TileGrid) -> int:
        r0, r1 = self.row_span(grid)
        return (r1 - r0) * (self.b1 - self.b0) * grid.band_bytes


def tile_region(
    grid: TileGrid, shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> TileRegion | None:
    """The tiles box ``offsets``/``sizes`` of the chunk touches, or None when the box does not take
    whole dims >= 2 (then it is a set of small runs inside bands: blocks verify it) or is empty."""
    if len(shape) < 2 or any(n == 0 for n in sizes):
        return None
    if any(o != 0 or n != s for o, n, s in zip(offsets[2:], sizes[2:], shape[2:])):
        return None
    per_band = grid.cols // grid.bands
    r0, r1 = offsets[0], offsets[0] + sizes[0]
    c0, c1 = offsets[1], offsets[1] + sizes[1]
    return TileRegion(r0 // grid.rows_per_tile, -(-r1 // grid.rows_per_tile), c0 // per_band, -(-c1 // per_band))


def region_tile_sums(
    rows: np.ndarray, grid: TileGrid, region: TileRegion, algo: Callable[[], object]
) -> list[tuple[int, int]]:
    """``(tile index, checksum)`` of every tile of ``region``, from ``rows``: the chunk's bytes of the
    region's dim-0 rows (``row_span``), whole rows, as a uint8 array (e.g. a mapping of the file)."""
    r0, r1 = region.row_span(grid)
    arr = rows.reshape(r1 - r0, grid.bands, grid.band_bytes)[:, region.b0 : region.b1]
    out: list[tuple[int, int]] = []
    for g in range(region.g0, region.g1):
        a, b = g * grid.rows_per_tile - r0, min(grid.rows, (g + 1) * grid.rows_per_tile) - r0
        tiles = np.ascontiguousarray(arr[a:b].transpose(1, 0, 2))
        out.extend((g * grid.bands + region.b0 + k, _hash(tiles[k], algo)) for k in range(region.b1 - region.b0))
    return out


def tile_entry(raw: memoryview, shape: Sequence[int], itemsize: int, algo: Callable[[], object]) -> list | None:
    """The I/O table's tile record of a chunk: ``[bands, rows_per_tile, sums]``, or None (no tiles)."""
    grid = tile_grid(shape, itemsize)
    return None if grid is None else [*grid.to_json(), tile_checksums(raw, grid, algo)]


def saved_tile_grid(entry: Sequence, shape: Sequence[int], itemsize: int, index: MetadataIndex) -> TileGrid:
    """The tile grid a checkpoint records for a chunk, checked against the chunk's shape (the
    table is untrusted input: a grid that does not tile the chunk is a corrupt checkpoint)."""
    try:
        bands, rows_per_tile, sums = int(entry[0]), int(entry[1]), entry[2]
        cols = int(shape[1])
        grid = TileGrid(int(shape[0]), cols, math.prod(shape[2:]) * itemsize, bands, rows_per_tile)
        ok = bands >= 1 and rows_per_tile >= 1 and cols % bands == 0 and len(sums) == grid.groups * bands
    except (TypeError, ValueError, IndexError, ZeroDivisionError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"the tile checksums of '{index.fqn}' chunk {list(index.offset or ())} do not tile its shape "
            f"{tuple(shape)} (recorded {list(entry[:2]) if isinstance(entry, (list, tuple)) else entry!r})",
            atom=index.fqn,
            saved=list(entry[:2]) if isinstance(entry, (list, tuple)) else None,
            wanted=tuple(shape),
            hint="the checkpoint's I/O table is damaged; restore the checkpoint from a good copy",
        )
    return grid
