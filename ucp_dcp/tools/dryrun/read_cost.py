"""What ``UCPFileSystemReader.read_data`` will request from storage for a list of read items,
computed without reading: the same decisions, in the same order, as the reader's ``_read_chunk``
(mapped window / direct runs / merged union / whole-item fallback), its checksum widening and its
edge reads for verification. ``ReadCost`` counts what ``ReadStats`` counts, so a plan's figures
are the load's figures; ``tests/tools/test_dryrun.py`` holds the two side by side.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..._compat import _create_file_view
from ...storage.file_ranges import REMOTE_GAP, WINDOW, coalesce_within
from ...storage.format import (
    BLOCK,
    HASHES,
    IO_KEY,
    BlockSums,
    TensorRecord,
    blocks_touching,
    box_grid,
    chunk_meta,
    entry_sums,
    item_key,
    merge_intervals,
    parse_tensor_record,
    split_grid,
)
from ...storage.tiled_read import plan_tiled, remote_windows
from ...storage.tiles import saved_tile_grid

__all__ = ["ReadCost", "CostModel", "Piece", "pieces", "item_nbytes"]

Piece = tuple[MetadataIndex, "tuple[int, ...] | None", "tuple[int, ...] | None"]
"""What the cost of a read item depends on: ``(storage index, offsets, lengths)`` in the saved
chunk, offsets None for an object read whole. A plan keeps these for every rank, not read items."""


def pieces(items: Sequence[ReadItem]) -> list[Piece]:
    """The :data:`Piece` of each read item (a few ints instead of a ReadItem's five objects)."""
    return [
        (it.storage_index, None, None)
        if it.type == LoadItemType.BYTE_IO
        else (it.storage_index, tuple(it.storage_offsets), tuple(it.lengths))
        for it in items
    ]


@dataclass
class ReadCost:
    """One rank's storage requests, as ``ReadStats`` counts them."""

    bytes_read: int = 0
    """Bytes requested from storage (incl. checksum widening, edge reads and whole-item fallbacks)."""
    ranges: int = 0
    """Read calls (each mapped window pass of a strided chunk counts once, as in the reader)."""
    items: set[str] = field(default_factory=set)
    """Storage items (``fqn|offsets``) read from."""
    files: set[str] = field(default_factory=set)
    """Data files opened."""
    fallbacks: int = 0
    """Items read whole, DCP-style (stream transforms or records the reader cannot range-read)."""
    largest_buffer: int = 0
    """Largest host buffer one chunk's read needs (a merged union of runs); 0 when every read
    lands in its target."""


class CostModel:
    """The reader's view of one checkpoint: its I/O table, checksum blocks (each record's), chunk records.

    Args:
        md: the checkpoint's metadata (``storage_data`` with the I/O table).
        path: the checkpoint folder, to parse the records of chunks another writer saved (their
            data offset is in the item's zip directory); None: such chunks count as fallbacks.
        verify: the reader verifies checksums (its default).
        local_files: the checkpoint is on a local file system (the reader maps strided windows).
        store_gap: on a store, the gaps the reader fetches too (its ``store_gap``: 0 for ``store_ranges="exact"``,
            :data:`~ucp_dcp.storage.file_ranges.REMOTE_GAP` for its default ``"few"``).
    """

    def __init__(
        self,
        md: Metadata,
        path: str | os.PathLike | None,
        verify: bool = True,
        local_files: bool = True,
        store_gap: int = REMOTE_GAP,
    ) -> None:
        self.md = md
        self.storage = md.storage_data or {}
        self.path = path
        self.local_files = local_files
        self.store_gap = store_gap
        iot = self.storage.get(MetadataIndex(IO_KEY)) or {}
        self.io_items = iot.get("items", {})
        algo = iot.get("algo")
        self.crc = self.io_items if (algo in HASHES and verify) else {}
        self.block = int(iot.get("block", BLOCK))  # objects', and every record's of a table up to version 3
        self.meta = chunk_meta(md)
        self._foreign: dict[MetadataIndex, TensorRecord | None] = {}

    def record(self, index: MetadataIndex) -> tuple[TensorRecord | None, bool]:
        """The chunk's record and whether reading it costs the reader a parse (one range)."""
        info = self.storage[index]
        entry = self.io_items.get(item_key(index))
        if entry is not None and entry[0] >= 0 and index in self.meta:
            dtype, sizes = self.meta[index]
            return TensorRecord(entry[0], dtype, sizes, True), False
        if info.transform_descriptors:
            return None, False
        if index not in self._foreign:
            self._foreign[index] = self._parse(index, info)
        return self._foreign[index], True

    def _parse(self, index: MetadataIndex, info: Any) -> TensorRecord | None:
        if self.path is None:
            return None
        if "://" in str(self.path):  # an object: ranged GETs of the item's zip directory, as the reader
            from ...storage.object_store import ObjectStore

            store = ObjectStore(str(self.path))
            with store.open_read(store.join(info.relative_path)) as f:
                return parse_tensor_record(_create_file_view(f, info.offset, info.length))
        with open(os.path.join(self.path, info.relative_path), "rb") as f:
            return parse_tensor_record(_create_file_view(f, info.offset, info.length))

    def cost(self, items: Sequence[ReadItem | Piece]) -> ReadCost:
        """Storage requests of reading ``items`` (one rank's items minus those it receives), given as
        read items or as their :func:`pieces`."""
        out = ReadCost()
        chunks: dict[MetadataIndex, list[Piece]] = {}
        for item in items:
            piece = item if isinstance(item, tuple) else pieces([item])[0]
            index = piece[0]
            info = self.storage[index]
            out.files.add(info.relative_path)
            if piece[1] is None:  # an object: read whole
                self._count(out, index, int(info.length))
                continue
            chunks.setdefault(index, []).append(piece)
        for index, chunk_pieces in chunks.items():
            self._chunk(out, index, chunk_pieces)
        return out

    def _count(self, out: ReadCost, index: MetadataIndex, nbytes: int, ranges: int = 1) -> None:
        out.bytes_read += int(nbytes)
        out.ranges += ranges
        out.items.add(item_key(index))

    def _chunk(self, out: ReadCost, index: MetadataIndex, items: list[Piece]) -> None:
        info = self.storage[index]
        record, parsed = self.record(index)
        if parsed:
            out.ranges += 1
        if record is None or not record.contiguous or info.transform_descriptors:
            out.fallbacks += 1
            self._count(out, index, info.length)
            return
        grids = [box_grid(record.shape, record.itemsize, offsets, lengths) for _, offsets, lengths in items]
        crcs = entry_sums(self.crc.get(item_key(index)), self.block, index)  # the reader's ``_sums``
        if self.local_files and any(g.nruns > 1 for g in grids):
            tiled = self._tiled_bytes(index, record, items) if crcs else None
            self._count(out, index, tiled if tiled is not None else self._mapped_bytes(grids, record.nbytes, crcs))
            return
        runs = [(g.starts(), g.run) for g in grids]
        total = sum(g.nbytes for g in grids)
        starts = np.concatenate([st for st, _ in runs])
        lens = np.concatenate([np.full(len(st), n, dtype=np.int64) for st, n in runs])
        if not self.local_files and any(g.nruns > 1 for g in grids):  # an object: the reader's store path
            if crcs and self._tiled_remote(out, index, record, items):
                return
            remote = coalesce_within(merge_intervals(starts, lens), gap=self.store_gap)
            if crcs:
                remote = blocks_touching(remote, record.nbytes, crcs.block)
            for _, n in remote:
                self._count(out, index, n)
            out.largest_buffer = max(out.largest_buffer, sum(n for _, n in remote))
            return
        intervals = merge_intervals(starts, lens) if len(items) > 1 or crcs else None
        disjoint = intervals is None or sum(n for _, n in intervals) == total
        if disjoint and (not crcs or all(len(st) == 1 for st, _ in runs)):
            for st, n in runs:  # straight into the targets
                if len(st) == 1 or not self.local_files:
                    for _ in range(len(st)):
                        self._count(out, index, n)
                else:
                    self._count(out, index, len(st) * n, ranges=len(st))
                if crcs:
                    self._edges(out, index, int(st[0]), n, record.nbytes, crcs.block)
            return
        assert intervals is not None
        if crcs:
            intervals = blocks_touching(intervals, record.nbytes, crcs.block)
        for _, n in intervals:
            self._count(out, index, n)
        out.largest_buffer = max(out.largest_buffer, sum(n for _, n in intervals))

    def _tiled_boxes(self, index: MetadataIndex, record: TensorRecord, items: list[Piece]) -> tuple[Any, list] | None:
        """The saved tile grid and the tiled reader's boxes for ``items``, or None when the reader verifies
        them by blocks instead (no tile sums recorded, or a box the tiles cannot serve)."""
        entry = self.crc.get(item_key(index))
        tiles = entry[3] if entry is not None and len(entry) > 3 else None
        if not tiles:
            return None
        grid = saved_tile_grid(tiles, record.shape, record.itemsize, index)
        boxes = plan_tiled(grid, record.shape, [(o, n) for _, o, n in items if o is not None and n is not None])
        if boxes is None or len(boxes) != len(items):
            return None
        return grid, boxes

    def _tiled_bytes(self, index: MetadataIndex, record: TensorRecord, items: list[Piece]) -> int | None:
        """Bytes of the tiles the boxes touch, each once, when the reader verifies them by tile
        sums (:mod:`ucp_dcp.storage.tiled_read`), else None."""
        tiled = self._tiled_boxes(index, record, items)
        if tiled is None:
            return None
        grid, boxes = tiled
        touched = {
            (g, b)
            for box in boxes
            for g in range(box.region.g0, box.region.g1)
            for b in range(box.region.b0, box.region.b1)
        }
        return sum(
            (min(grid.rows, (g + 1) * grid.rows_per_tile) - g * grid.rows_per_tile) * grid.band_bytes
            for g, _ in touched
        )

    def _tiled_remote(self, out: ReadCost, index: MetadataIndex, record: TensorRecord, items: list[Piece]) -> bool:
        """The ranged requests of boxes verified by tile sums from an object (each box's touched bands, row
        by row, joined within the waste budget: :func:`~ucp_dcp.storage.tiled_read.remote_windows`);
        False when the reader verifies them by blocks instead."""
        tiled = self._tiled_boxes(index, record, items)
        if tiled is None:
            return False
        grid, boxes = tiled
        for box in boxes:
            for _, ranges in remote_windows(0, grid, box, self.store_gap):
                self._count(out, index, sum(n for _, n in ranges), ranges=len(ranges))
        return True

    def _mapped_bytes(self, grids: list[Any], nbytes: int, crcs: BlockSums) -> int:
        B = crcs.block
        if crcs:
            verified: set[int] = set()
            for g in grids:
                for piece in split_grid(g, WINDOW):
                    lo, hi = piece.first // B * B, min(nbytes, -(-piece.end // B) * B)
                    verified.update(range(lo // B, -(-hi // B)))
            return sum(min((b + 1) * B, nbytes) - b * B for b in verified)
        if len(grids) == 1:
            return grids[0].nbytes
        merged = merge_intervals(
            np.concatenate([g.starts() for g in grids]),
            np.concatenate([np.full(g.nruns, g.run, dtype=np.int64) for g in grids]),
        )
        return sum(n for _, n in merged)

    def _edges(self, out: ReadCost, index: MetadataIndex, start: int, n: int, nbytes: int, block: int) -> None:
        """The parts of the first and last checksum block (of ``block`` bytes) outside a directly read run."""
        B, end = block, start + n
        for b in range(start // B, (max(end, start + 1) - 1) // B + 1):
            bs, be = b * B, min((b + 1) * B, nbytes)
            a, c = max(bs, start), min(be, end)
            if bs < a:
                self._count(out, index, a - bs)
            if c < be:
                self._count(out, index, be - c)


def item_nbytes(md: Metadata, item: ReadItem) -> int:
    """Bytes of saved data one read item needs (what read-once sends for it)."""
    if item.type == LoadItemType.BYTE_IO:
        return int(getattr((md.storage_data or {}).get(item.storage_index), "length", 0))
    return math.prod(item.lengths) * md.state_dict_metadata[item.storage_index.fqn].properties.dtype.itemsize
