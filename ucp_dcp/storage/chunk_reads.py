"""The local reads of :class:`~ucp_dcp.storage.reader.UCPFileSystemReader`, one file at a time.

Read items are grouped by saved chunk (a chunk feeding several target boxes is read once) and by file;
a file's chunks are read in offset order: a tensor chunk's byte runs (see :mod:`ucp_dcp.storage.format`)
straight into the target when they are one contiguous run of matching dtype, else through a buffer,
from a read-only mapping of the file when it is local (:func:`~ucp_dcp.storage.file_ranges.regular_fd`)
or by ranged reads; widened to whole checksum blocks when verifying; objects whole, checked against
their checksum as stored, then decoded through their stream transforms (DCP's ``_extension_registry``)
when delivered. What cannot be read by ranges falls back to DCP's whole-item path. A mixin: the reader
holds the state (``storage_data``, ``fs``, checksums, stats) these methods use.

Kept in one module (about 510 lines once formatted): one mixin whose methods hand a chunk to each
other (direct, union, mapped, fallback reads) and share the reader's verification state.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._compat import _create_file_view, narrow_tensor_by_index
from ..errors import CorruptCheckpointError, MissingFileError, TruncatedFileError, UCPError, UnsafeCheckpointError
from .checksums import BlockChecker
from .commit import Integrity
from .file_ranges import WINDOW, coalesce_within, gather_runs, map_window, readinto, regular_fd
from .format import (
    HASHES,
    NO_SUMS,
    BlockSums,
    BoxGrid,
    TensorRecord,
    block_hash,
    blocks_touching,
    box_grid,
    entry_sums,
    gather_grid,
    item_key,
    merge_intervals,
    parse_tensor_record,
    split_grid,
)
from .object_prefetch import prefetch_batches
from .object_streams import RangedObjectFile
from .read_job import ReadJob, ReadStats
from .tiled_read import plan_tiled, read_tiled, read_tiled_remote
from .tiles import saved_tile_grid

__all__ = ["ChunkReads"]


@dataclass
class _Chunk:
    """One saved chunk and the local read items it feeds."""

    index: MetadataIndex
    info: Any
    record: TensorRecord | None
    items: list[ReadItem] = field(default_factory=list)


class ChunkReads:
    """Reading a rank's chunks file by file (mixed into :class:`~ucp_dcp.storage.reader.UCPFileSystemReader`).
    The attributes below are the reader's (DCP's ``FileSystemReader`` and ucp_dcp's ``set_up_storage_reader``)."""

    fs: Any
    path: Any
    storage_data: dict[MetadataIndex, Any]
    transforms: Any
    stats: ReadStats
    integrity: Integrity | None
    verify_checksums: bool
    _lock: threading.Lock
    _checker: BlockChecker
    _records: dict[MetadataIndex, TensorRecord | None]
    _crc: dict[str, Any]
    _io: dict[str, Any]
    _chunk_meta: Any
    _block: int
    """The I/O table's block (objects', and every record's of a table up to version 3)."""
    _algo: str | None
    store_gap: int

    def _by_file(self, items: list[ReadItem]) -> dict[str, list[_Chunk]]:
        """Items grouped by saved chunk (a chunk feeding several boxes is one read), by file."""
        chunks: dict[MetadataIndex, _Chunk] = {}
        by_file: dict[str, list[_Chunk]] = defaultdict(list)
        for item in items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                by_file[info.relative_path].append(_Chunk(item.storage_index, None, None, [item]))
                continue
            c = chunks.get(item.storage_index)
            if c is None:
                c = chunks[item.storage_index] = _Chunk(item.storage_index, info, None)
                by_file[info.relative_path].append(c)
            c.items.append(item)
        return by_file

    def _read_file(self, job: ReadJob, rel: str, cs: list[_Chunk]) -> None:
        cs.sort(key=lambda c: self.storage_data[c.index].offset)
        atoms = sorted({c.index.fqn for c in cs})
        try:
            with self._open_file(rel) as f:
                self._check_size(f, rel, atoms)
                # an object on a store: the small items' bytes in a few requests (ucp_dcp.storage.object_prefetch)
                remote = isinstance(f, RangedObjectFile)
                batches, of = prefetch_batches(cs, lambda c: self._whole_span(f, c)) if remote else ([], {})
                held = -1
                for c in cs:
                    if of.get(id(c), held) != held:
                        held = of[id(c)]
                        f.prefetch(batches[held])
                    if c.info is None:
                        self._read_object(f, rel, c, job)
                    else:
                        self._read_chunk(f, rel, c, job)
        except FileNotFoundError as e:
            if isinstance(e, UCPError):
                raise
            raise MissingFileError(
                f"checkpoint file {rel} is missing from {self.path} (it holds {_names(atoms)})",
                atom=atoms[0],
                saved=rel,
                hint="the checkpoint is incomplete (a partial copy?); copy the whole folder again",
            ) from None

    def _whole_span(self, f: Any, c: _Chunk) -> tuple[int, int] | None:
        """The bytes chunk ``c`` needs when they are one span known without reading: an object's record, or
        a tensor whose every item takes it whole (its data offset from the I/O table). None otherwise."""
        info = self.storage_data[c.index]
        if c.info is None:
            return int(info.offset), int(info.length)
        entry = self._io.get("items", {}).get(item_key(c.index))
        if info.transform_descriptors or entry is None or entry[0] < 0 or c.index not in self._chunk_meta:
            return None
        sizes = list(self._chunk_meta[c.index][1])
        if not all(not any(it.storage_offsets) and list(it.lengths) == sizes for it in c.items):
            return None
        record = self._record(f, c.index, info)  # from the I/O table: no read
        return (int(info.offset + record.data_offset), int(record.nbytes)) if record is not None else None

    def _open_file(self, rel: str) -> Any:
        """A read stream of the checkpoint file ``rel`` (the reader opens object-store files its own way)."""
        return self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb")

    def _read_object(self, f: Any, rel: str, c: _Chunk, job: ReadJob) -> None:
        info = self.storage_data[c.index]
        data = self._pread(f, info.offset, info.length, c.index)
        entry = self._crc.get(item_key(c.index)) if self.verify_checksums else None
        if entry is not None:
            self._checker.verify(data, 0, entry_sums(entry, self._block, c.index), rel, c.index)
        elif self.verify_checksums and self._crc and int(self._io.get("version", 1)) >= 2:
            raise CorruptCheckpointError(
                f"object '{c.index.fqn}' has no checksum in the checkpoint's I/O table",
                atom=c.index.fqn,
                hint="the checkpoint's tables are damaged",
            )
        # verified as stored (the writer's checksum covers the file's bytes); kept and sent as stored too, each
        # rank undoing the item's stream transforms when it delivers the object (ReadJob.decoded)
        job.keep_if_sent(c.items[0], data)
        with self._lock:
            job.objects.append((c.items[0], data))

    def _read_chunk(self, f: Any, rel: str, c: _Chunk, job: ReadJob) -> None:
        """The boxes of one saved chunk: strided boxes of a local file through a mapped window,
        disjoint ones straight into their destinations, overlapping ones as one union."""
        info = self.storage_data[c.index]
        record = self._record(f, c.index, info)
        if record is None or not record.contiguous or info.transform_descriptors:
            self._fallback(f, c, info, job)
            return
        grids = {
            id(item): box_grid(record.shape, record.itemsize, item.storage_offsets, item.lengths) for item in c.items
        }
        crcs = self._sums(c.index) if self.verify_checksums else NO_SUMS
        base = info.offset + record.data_offset
        fd = regular_fd(f)
        if fd is not None and any(g.nruns > 1 for g in grids.values()):
            self._read_mapped(fd, rel, c, grids, base, record, crcs, job)
            return
        runs = {k: (g.starts(), g.run) for k, g in grids.items()}
        total = sum(g.nbytes for g in grids.values())
        starts = np.concatenate([st for st, _ in runs.values()])
        lens = np.concatenate([np.full(len(st), n, dtype=np.int64) for st, n in runs.values()])
        if isinstance(f, RangedObjectFile) and any(g.nruns > 1 for g in grids.values()):
            # a remote file: a request per run costs a round trip each; runs are joined across their smallest
            # gaps within REMOTE_WASTE of the bytes needed. Boxes taking whole dims >= 2 of a chunk with tile
            # sums are verified by their tiles (exact bytes), others by whole checksum blocks.
            if crcs and self._read_tiles(f, rel, c, base, record, job):
                return
            merged = merge_intervals(starts, lens)
            self._read_union(f, rel, c, runs, coalesce_within(merged, gap=self.store_gap), base, record, crcs, job)
            return
        intervals = merge_intervals(starts, lens) if len(c.items) > 1 or crcs else None
        disjoint = intervals is None or sum(n for _, n in intervals) == total
        if disjoint and (not crcs or all(len(runs[id(it)][0]) == 1 for it in c.items)):
            self._read_direct(f, rel, c, runs, base, record, crcs, job)
        else:
            self._read_union(f, rel, c, runs, intervals, base, record, crcs, job)

    def _read_direct(
        self,
        f: Any,
        rel: str,
        c: _Chunk,
        runs: dict[int, tuple[np.ndarray, int]],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Each item's runs straight into its destination; a single-run item verifies the blocks it
        touches from that memory, reading only their edges."""
        for item in c.items:
            st, n = runs[id(item)]
            target, mv = job.destination(item, record, len(st) * n)
            self._pread_runs(f, base, st, n, mv, c.index)
            if crcs:
                self._checker.verify_span(
                    lambda off, n: self._pread(f, off, n, c.index),
                    base,
                    int(st[0]),
                    mv,
                    crcs,
                    record.nbytes,
                    rel,
                    c.index,
                )
            job.finish(item, target, mv, record)

    def _read_union(
        self,
        f: Any,
        rel: str,
        c: _Chunk,
        runs: dict[int, tuple[np.ndarray, int]],
        intervals: list[tuple[int, int]],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Items sharing bytes, or runs to verify: the union read once (whole checksum blocks)."""
        if crcs:
            intervals = blocks_touching(intervals, record.nbytes, crcs.block)
        buffers = []
        fetched = None
        if isinstance(f, RangedObjectFile) and len(intervals) > 1:  # all in flight at once: a round trip, not n
            fetched = f.read_ranges([(base + s, n) for s, n in intervals])
            for (_, n), data in zip(intervals, fetched):
                if len(data) != n:
                    raise TruncatedFileError(
                        f"checkpoint file {rel} ended early reading '{c.index.fqn}': the file is truncated",
                        atom=c.index.fqn,
                        hint="restore the file from a good copy",
                    )
                self._note(c.index, n)
        for k, (start, length) in enumerate(intervals):
            buf = memoryview(fetched[k]) if fetched is not None else self._pread(f, base + start, length, c.index)
            if crcs:
                self._checker.verify(buf, start, crcs, rel, c.index)
            buffers.append((start, buf))
        bstarts = [b[0] for b in buffers]
        for item in c.items:
            st, n = runs[id(item)]
            data = gather_runs(buffers, bstarts, st, n)
            job.keep_if_sent(item, data)
            job.deliver(item, data, record.dtype)

    def _read_mapped(
        self,
        fd: int,
        rel: str,
        c: _Chunk,
        grids: dict[int, BoxGrid],
        base: int,
        record: TensorRecord,
        crcs: BlockSums,
        job: ReadJob,
    ) -> None:
        """Strided boxes of a local file: map a bounded window of the chunk at a time and copy the
        runs out with one strided copy (a syscall per run costs more than the bytes). Blocks the
        window touches are verified once each, from the mapping."""
        size = os.fstat(fd).st_size
        if base + record.nbytes > size:
            raise TruncatedFileError(
                f"checkpoint file {rel} ends at byte {size}, before the data of '{c.index.fqn}' "
                f"(needed up to {base + record.nbytes}): the file is truncated",
                atom=c.index.fqn,
                hint="the checkpoint is incomplete or damaged; restore the file from a good copy",
            )
        if crcs and self._read_tiles(fd, rel, c, base, record, job):
            return
        B = crcs.block
        verified: set[int] = set()
        for item in c.items:
            g = grids[id(item)]
            target, mv = job.destination(item, record, g.nbytes)
            out = np.frombuffer(mv, dtype=np.uint8) if g.nbytes else np.empty(0, dtype=np.uint8)
            done = 0
            for piece in split_grid(g, WINDOW):
                lo, hi = piece.first, piece.end
                if crcs:
                    lo, hi = lo // B * B, min(record.nbytes, -(-hi // B) * B)
                window = map_window(fd, base + lo, hi - lo)
                for b in range(lo // B, -(-hi // B)) if crcs else ():
                    if b not in verified:
                        blk = window[b * B - lo : min((b + 1) * B, record.nbytes) - lo]
                        self._checker.check(b, block_hash(blk, self._algo), crcs, rel, c.index)
                        verified.add(b)
                gather_grid(window, lo, piece, out[done : done + piece.nbytes])
                done += piece.nbytes
                del window
            job.finish(item, target, mv, record)
        if crcs:
            nbytes = sum(min((b + 1) * B, record.nbytes) - b * B for b in verified)
        elif len(c.items) == 1:
            nbytes = next(iter(grids.values())).nbytes
        else:
            gs = list(grids.values())
            merged = merge_intervals(
                np.concatenate([g.starts() for g in gs]),
                np.concatenate([np.full(g.nruns, g.run, dtype=np.int64) for g in gs]),
            )
            nbytes = sum(n for _, n in merged)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += 1
            self.stats.items.append(item_key(c.index))

    def _read_tiles(self, src: Any, rel: str, c: _Chunk, base: int, record: TensorRecord, job: ReadJob) -> bool:
        """Strided boxes verified by the chunk's tile sums (reading the tiles they touch, not whole
        checksum blocks), from a local file's descriptor or an object (:class:`RangedObjectFile`);
        False when the chunk has none or a box does not take whole dims >= 2."""
        entry = self._crc.get(item_key(c.index))
        tiles = entry[3] if entry is not None and len(entry) > 3 else None
        if not tiles:
            return False
        grid = saved_tile_grid(tiles, record.shape, record.itemsize, c.index)
        boxes = plan_tiled(grid, record.shape, [(it.storage_offsets, it.lengths) for it in c.items])
        if boxes is None:
            return False
        sums, nbytes, requests = tiles[2], 0, 0
        verified: set[int] = set()
        algo = HASHES[self._algo or ""]

        def check(t: int, got: int) -> None:
            self._checker.check_tile(t, got, sums, rel, c.index)

        for item, box in zip(c.items, boxes):
            n = math.prod(box.sizes) * record.itemsize
            target, mv = job.destination(item, record, n)
            out = np.frombuffer(mv, dtype=np.uint8) if n else np.empty(0, dtype=np.uint8)
            if isinstance(src, RangedObjectFile):
                got, reqs = read_tiled_remote(
                    src.read_ranges,
                    base,
                    record.shape,
                    record.itemsize,
                    grid,
                    box,
                    out,
                    verified,
                    check,
                    algo,
                    self.store_gap,
                )
                nbytes, requests = nbytes + got, requests + reqs
            else:
                nbytes += read_tiled(src, base, record.shape, record.itemsize, grid, box, out, verified, check, algo)
                requests += 1
            job.finish(item, target, mv, record)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += requests
            self.stats.items.append(item_key(c.index))
        return True

    def _fallback(self, f: Any, c: _Chunk, info: Any, job: ReadJob) -> None:
        """DCP's path: deserialize the whole item, then narrow."""
        self.stats.fallbacks += 1
        raw = self._pread(f, info.offset, info.length, c.index)
        stream = self.transforms.transform_load_stream(c.items[0], info.transform_descriptors or (), io.BytesIO(raw))
        data = stream.read() if not stream.seekable() else stream
        try:
            tensor = torch.load(
                data if isinstance(data, io.IOBase) else io.BytesIO(data), map_location="cpu", weights_only=True
            )
        except pickle.UnpicklingError:
            raise UnsafeCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} is not a "
                "plain tensor: decoding it could run code",
                atom=c.index.fqn,
                hint="the checkpoint was crafted or damaged; do not load it",
            ) from None
        except Exception as e:  # the bytes are untrusted: any parser failure is damage, re-raised as that
            raise CorruptCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} does not "
                f"parse ({type(e).__name__}: {e})",
                atom=c.index.fqn,
                hint="the checkpoint file is damaged; restore it from a good copy",
            ) from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(
                f"the record of '{c.index.fqn}' holds a {type(tensor).__name__}, not a tensor", atom=c.index.fqn
            )
        for item in c.items:
            # a conjugate or negative view (stock DCP saves them as such): its values, not its memory
            piece = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths).resolve_conj().resolve_neg()
            piece = piece.contiguous()
            job.keep_if_sent(item, memoryview(bytearray(piece.view(-1).view(torch.uint8).numpy().tobytes())))
            job.deliver(item, memoryview(piece.view(-1).view(torch.uint8).numpy()), piece.dtype)

    # -- helpers -----------------------------------------------------------------------------------

    def _check_size(self, f: Any, rel: str, atoms: list[str]) -> None:
        """A file must have the size it was written with (known from a verified sidecar)."""
        want = (self.integrity.files or {}).get(rel) if self.integrity is not None else None
        if want is None:
            return
        try:
            have = os.fstat(f.fileno()).st_size
        except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
            have = getattr(f, "size", None)
        if have is not None and have != want:
            raise TruncatedFileError(
                f"checkpoint file {rel} has {have} bytes, {want} were written: the file is "
                f"{'truncated' if have < want else 'longer than written'} (it holds {_names(atoms)})",
                atom=atoms[0],
                saved=want,
                wanted=have,
                hint="the checkpoint is damaged (an interrupted copy?); restore the file from a good copy",
            )

    def _sums(self, index: MetadataIndex) -> BlockSums:
        """The saved chunk's block sums with their block (:data:`NO_SUMS` when it has none)."""
        return entry_sums(self._crc.get(item_key(index)), self._block, index)

    def _record(self, f: Any, index: MetadataIndex, info: Any) -> TensorRecord | None:
        with self._lock:
            if index in self._records:
                return self._records[index]
        entry = self._io.get("items", {}).get(item_key(index))
        rec: TensorRecord | None = None
        if entry is not None and entry[0] >= 0 and index in self._chunk_meta:
            dtype, sizes = self._chunk_meta[index]  # our writer: compact row-major, offset recorded
            rec = TensorRecord(entry[0], dtype, sizes, True)
        elif not info.transform_descriptors:  # another writer: read the item's zip directory
            rec = parse_tensor_record(_create_file_view(f, info.offset, info.length))
            with self._lock:
                self.stats.ranges += 1
        with self._lock:
            self._records[index] = rec
        return rec

    def _pread_runs(
        self, f: Any, base: int, starts: np.ndarray, run: int, out: memoryview, index: MetadataIndex
    ) -> None:
        """Read equal-length runs at ``base + starts`` into consecutive parts of ``out``."""
        if len(starts) == 1 or not hasattr(f, "fileno") or isinstance(f, RangedObjectFile):
            for k, s0 in enumerate(starts.tolist()):
                self._pread_into(f, base + s0, out[k * run : (k + 1) * run], index)
            return
        fd = f.fileno()
        pos = 0
        for s0 in (starts + base).tolist():
            got = os.preadv(fd, [out[pos : pos + run]], s0)
            if got != run:
                self._pread_into(f, s0, out[pos : pos + run], index)  # short read: finish the slow way
                got = run
                with self._lock:
                    self.stats.bytes_read -= run
                    self.stats.ranges -= 1
            pos += got
        with self._lock:
            self.stats.bytes_read += pos
            self.stats.ranges += len(starts)
            self.stats.items.append(item_key(index))

    def _pread(self, f: Any, offset: int, length: int, index: MetadataIndex) -> memoryview:
        buf = bytearray(length)
        self._pread_into(f, offset, memoryview(buf), index)
        return memoryview(buf)

    def _pread_into(self, f: Any, offset: int, out: memoryview, index: MetadataIndex) -> None:
        f.seek(offset)
        n = f.readinto(out) if hasattr(f, "readinto") else readinto(f, out)
        while n is not None and n < len(out):  # short reads (pipes, remote files)
            more = f.readinto(out[n:]) if hasattr(f, "readinto") else readinto(f, out[n:])
            if not more:
                raise TruncatedFileError(
                    f"checkpoint file ended early reading '{index.fqn}': the file is truncated",
                    atom=index.fqn,
                    hint="restore the file from a good copy",
                )
            n += more
        self._note(index, len(out))

    def _note(self, index: MetadataIndex, nbytes: int) -> None:
        with self._lock:
            self.stats.bytes_read += int(nbytes)
            self.stats.ranges += 1
            self.stats.items.append(item_key(index))


def _names(atoms: list[str]) -> str:
    return ", ".join(f"'{a}'" for a in atoms[:3]) + (f" and {len(atoms) - 3} more" if len(atoms) > 3 else "")
