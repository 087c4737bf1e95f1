"""Column slices made cheap: tile checksums (verification whose granularity follows column reads) and, on
object stores, column bands (chunks laid out so a column slice is a few ranges; the last section).

Tile checksums.

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
from typing import Literal

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import CorruptCheckpointError

__all__ = [
    "TILE",
    "MAX_BANDS",
    "MAX_BAND_CHUNKS",
    "MIN_BAND",
    "TileGrid",
    "tile_grid",
    "tile_checksums",
    "tile_region",
    "TileRegion",
    "region_tile_sums",
    "saved_tile_grid",
    "tile_entry",
    "BAND_BYTES",
    "ColumnBands",
    "column_bands",
    "band_boxes",
    "band_chunks",
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


# -- column bands: 2-D+ chunks laid out on object stores so a column slice is a few ranges -------------------------
# Column bands: how the writer lays 2-D+ chunks out on object stores so a column slice is a few ranges.
#
# A chunk saved row-major puts a column slice (a tensor saved sharded on dim 0, loaded sharded on dim 1:
# a tensor-parallel dim change) in one run per saved row. A local file serves those runs from a mapping;
# an object store serves one range per request, so a slice of narrow rows costs either a request per row
# (8,160 GETs for 8 MiB) or whole rows (4x the bytes at a degree of 4). Stores give no multi-range GET
# (S3 answers one range per request).
#
# So, on object stores, the writer cuts such a chunk along dim 1 into ``bands`` equal **band chunks**,
# each an ordinary DCP chunk (its own ``torch.save`` record, written one after the other in the same
# object, its own block and tile sums). The checkpoint stays DCP's format — the metadata simply lists
# more, narrower chunks, which every DCP reader and planner reshards from — and:
#
# * a column slice whose edges fall on band edges (every degree dividing ``bands``) is whole band
#   chunks, consecutive in the object: one range, the slice's bytes plus a record frame per band;
# * a row slice (a data-parallel change) is one range per band instead of one per chunk, which is why a
#   band chunk holds at least :data:`BAND_BYTES` (the bytes the reader prices a request at) and there
#   are at most :data:`MAX_BAND_CHUNKS`.
#
# Pure functions; :class:`~ucp_dcp.storage.writer.UCPFileSystemWriter` applies them.
ColumnBands = Literal["store", "always", "off"]
"""Where the writer cuts chunks into column bands: on object stores only (default), everywhere, nowhere."""

BAND_BYTES = 1 << 20
"""Fewest bytes per band chunk: a row slice costs a request per band, so a band is worth a request."""
MAX_BAND_CHUNKS = 8
"""Most bands per chunk: tensor-parallel degrees 2, 4 and 8 (dividing dim 1) read whole bands."""
MIN_RUN = 512
"""Fewest bytes of one row inside a band (narrower runs gain nothing over whole rows)."""


def column_bands(sizes: Sequence[int], itemsize: int) -> int:
    """How many band chunks a chunk of ``sizes`` is written as (1: as it is). The largest of
    :data:`MAX_BAND_CHUNKS`, ..., 2 dividing dim 1 that leaves every band chunk :data:`BAND_BYTES` or more
    and every row's band :data:`MIN_RUN` bytes or more."""
    if len(sizes) < 2:
        return 1
    cols, inner = int(sizes[1]), math.prod(sizes[2:]) * itemsize
    nbytes = int(sizes[0]) * cols * inner
    b = MAX_BAND_CHUNKS
    while b >= 2:
        if cols % b == 0 and nbytes // b >= BAND_BYTES and cols // b * inner >= MIN_RUN:
            return b
        b //= 2
    return 1


def band_boxes(offsets: Sequence[int], sizes: Sequence[int], bands: int) -> list[tuple[torch.Size, torch.Size]]:
    """``(offsets, sizes)`` of the ``bands`` band chunks of the chunk at ``offsets`` of ``sizes``, in dim-1 order."""
    width = int(sizes[1]) // bands
    out = []
    for k in range(bands):
        offs = list(offsets)
        offs[1] = int(offsets[1]) + k * width
        out.append((torch.Size(offs), torch.Size([sizes[0], width, *sizes[2:]])))
    return out


def band_chunks(metadata: Metadata, banded: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]]) -> None:
    """Replace in ``metadata`` every chunk of ``banded`` — ``(fqn, offsets)``: ``(sizes, bands)`` — by its
    band chunks. A chunk already replaced (metadata a cached plan reuses: its first band has the chunk's
    offsets but not its sizes) is left as it is."""
    by_fqn: dict[str, dict[tuple[int, ...], tuple[tuple[int, ...], int]]] = {}
    for (fqn, offsets), cut in banded.items():
        by_fqn.setdefault(fqn, {})[tuple(offsets)] = cut
    for fqn, cuts in by_fqn.items():
        smd = metadata.state_dict_metadata.get(fqn)
        if not isinstance(smd, TensorStorageMetadata):
            continue
        chunks: list[ChunkStorageMetadata] = []
        for c in smd.chunks:
            sizes, bands = cuts.get(tuple(c.offsets), ((), 1))
            if bands > 1 and tuple(c.sizes) == tuple(sizes):
                chunks.extend(ChunkStorageMetadata(o, s) for o, s in band_boxes(c.offsets, c.sizes, bands))
            else:
                chunks.append(c)
        smd.chunks = chunks
