"""``UCPFileSystemReader``: reads only the bytes each rank needs, each file once, in offset order.

DCP's ``FileSystemReader`` deserializes a whole saved chunk for every read item and narrows it, so
resharding reads several times the needed bytes. Here every read item becomes byte runs of its
chunk (see :mod:`ucp_dcp.io_format`); the runs of all items of a chunk are merged (a chunk feeding
several target boxes is read once), widened to whole checksum blocks when verifying, and read with
one open file per thread, in offset order. A single contiguous run of matching dtype lands directly
in the target tensor; anything else goes through a buffer of at most one chunk's needed bytes.
Pieces the coordinator marked as shared are read by one rank and sent to the others
(:mod:`ucp_dcp.transport`). Items this reader cannot read by ranges (stream transforms, foreign
records) fall back to DCP's whole-item path. Device targets (CUDA tensors) are reached through
bounded host staging buffers and non-blocking copies (:mod:`ucp_dcp.staging`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import threading
import time
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .commit import Integrity, open_checkpoint
from .block_checks import BlockChecker
from .tiled_read import plan_tiled, read_tiled
from .tiles import saved_tile_grid
from .file_ranges import WINDOW, gather_runs, map_window, readinto, regular_fd
from .errors import (CorruptCheckpointError, MissingFileError, TruncatedFileError, UCPError,
                     UnsafeCheckpointError, UnverifiedCheckpointWarning)
from .io_format import (HASHES, IO_KEY, BoxGrid, TensorRecord, blocks_touching, box_grid, gather_grid, merge_intervals,
                        block_hash, check_tables, chunk_meta, item_key, parse_tensor_record, split_grid)
from . import device as _device
from ._compat import _create_file_view, fsspec_filesystem, narrow_tensor_by_index
from .collectives import p2p_group
from .device import needs_staging, split_reads, staging_forced
from .plans import ReadSummary, TransportPlan
from .read_job import ReadJob, ReadStats
from .staging import BUFFERS_PER_THREAD
from .transport import READ_ONCE_MODES, as_bytes_tensor, exchange, local_summary, plan_transport

__all__ = ["UCPFileSystemReader", "ReadStats"]


@dataclass
class _Chunk:
    """One saved chunk and the local read items it feeds."""

    index: MetadataIndex
    info: Any
    record: TensorRecord | None
    items: list[ReadItem] = field(default_factory=list)


class UCPFileSystemReader(FileSystemReader):
    """Ranged, checksummed, read-once ``StorageReader`` for DCP checkpoints (local or fsspec paths).

    Opening a checkpoint never runs code from it: the metadata is rebuilt from its JSON sidecar
    (checked against the ``.metadata`` bytes and its own hash), or, for checkpoints without one,
    unpickled with an allow-list of DCP's metadata types (:mod:`ucp_dcp.sidecar`).

    The positional parameters are ``FileSystemReader``'s, in its order (a drop-in); ucp_dcp's own
    options are keyword-only after them.

    Args:
        path: checkpoint folder or fsspec URL.
        _extension_registry: as in DCP: the stream transforms items written with them are decoded
            by (those items are read whole, DCP's way).
        thread_count: files read concurrently by this rank.
        verify_checksums: verify the checksum of every 1 MiB block and object read (when the
            checkpoint has them).
        trust: unpickle a checkpoint's metadata without the allow-list (only for checkpoints from a
            source you trust whose metadata holds other types).
        staging: ``"auto"``: stage only non-CPU targets through host buffers; ``"always"``: CPU
            targets too (exercises the device path without a GPU). None: ``$UCP_DCP_STAGING``.
        read_once: who receives saved bytes several ranks need, read by one rank the coordinator
            picks: ``"hosts"`` (only ranks on other hosts than the reader: the reader's host's page
            cache serves its neighbours), ``"ranks"`` (every other rank), ``"off"`` (every rank
            reads what it needs). None: the load planner's ``read_once`` (``UCPLoadPlanner``'s
            default ``"hosts"``). The host is ``socket.gethostname()`` or ``$UCP_DCP_HOST``.
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None, *, thread_count: int = 4,
                 verify_checksums: bool = True, trust: bool = False, staging: str | None = None,
                 read_once: str | None = None) -> None:
        super().__init__(path, _extension_registry)
        if "://" in str(path):
            self.fs = fsspec_filesystem()()
            self.path = self.fs.init_path(path)
        self.thread_count = thread_count
        self.verify_checksums = verify_checksums
        self.trust = trust
        if read_once is not None and read_once not in READ_ONCE_MODES:
            raise UCPError(f"read_once={read_once!r}: expected one of {READ_ONCE_MODES}")
        self.read_once = read_once
        self._forced = staging_forced(staging)
        self.stage_bytes = _device.STAGE_BYTES
        """Size of a staging buffer (and the largest item read into one)."""
        self.stats = ReadStats()
        self.integrity: Integrity | None = None
        """How far the opened checkpoint can be verified (set by ``read_metadata``)."""

    def _open(self) -> tuple[Metadata, Integrity]:
        """The checkpoint's metadata and how far it can be verified (readers of other formats
        override this and inherit the error handling of :meth:`read_metadata`)."""
        return open_checkpoint(self.fs, self.path, trust=self.trust)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            md, self.integrity = self._open()
        except UCPError as e:
            # dcp.load turns read_metadata's exceptions into a bare AssertionError string; hand back
            # an empty Metadata carrying the error, raised by set_up_storage_reader / the planner
            self.integrity = None
            md = Metadata(state_dict_metadata={}, storage_data={})
            md._ucp_error = e  # type: ignore[attr-defined]
            return md
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        md._ucp_integrity = self.integrity.status  # type: ignore[attr-defined]  # seen by UCPLoadPlanner
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if getattr(metadata, "_ucp_error", None) is not None:
            raise metadata._ucp_error  # type: ignore[attr-defined]
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_tables(metadata)
        if self.integrity is None:  # metadata handed in by the caller, not read here
            self.integrity = Integrity("partial" if (self.storage_data.get(MetadataIndex(IO_KEY)) or {}).get("algo")
                                       else "none")
        if is_coordinator and self.integrity.status != "verified" and self.verify_checksums:
            warnings.warn(_UNVERIFIED[self.integrity.status].format(path=self.path), UnverifiedCheckpointWarning,
                          stacklevel=2)
        self._io = self.storage_data.get(MetadataIndex(IO_KEY)) or {}
        algo = self._io.get("algo")
        self._algo = algo if algo in HASHES else None
        if algo is not None and self._algo is None and self.verify_checksums:
            warnings.warn(f"checkpoint checksums use '{algo}', which this ucp_dcp cannot verify: reading "
                          "without verification (upgrade ucp_dcp to verify them)", stacklevel=2)
        self._crc = self._io.get("items", {}) if self._algo else {}
        self._block = int(self._io.get("block", 1 << 20))
        self._checker = BlockChecker(self._block, self._algo or "")
        self._records: dict[MetadataIndex, TensorRecord | None] = {}
        self._lock = threading.Lock()
        self._chunk_meta = chunk_meta(metadata)
        self._md = metadata

    # -- planning: read-once ------------------------------------------------------------------------

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Summarize this rank's reads for read-once (keys and sizes, not items). A planner that
        puts its items back in ``finish_plan`` (``LoadPlanPayload.keeps_items``) gets them left out
        of the gathered plan, so planning stays O(summary) per rank."""
        pd = plan.planner_data
        mode = self.read_once or getattr(pd, "read_once", None) or "hosts"
        if mode not in READ_ONCE_MODES:
            raise UCPError(f"read_once={mode!r}: expected one of {READ_ONCE_MODES}")
        summary = local_summary(plan.items, self._md, mode)
        return LoadPlan([] if getattr(pd, "keeps_items", False) else plan.items, storage_data=summary,
                        planner_data=pd)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Pick one reader for every piece several ranks need (see :mod:`ucp_dcp.transport`)."""
        summaries = [p.storage_data if isinstance(p.storage_data, ReadSummary) else None for p in plans]
        return [dataclasses.replace(p, storage_data=t) for p, t in zip(plans, plan_transport(summaries))]

    # -- entry point -------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.stats = ReadStats()
        t0 = time.perf_counter()
        transport = plan.storage_data if isinstance(plan.storage_data, TransportPlan) else TransportPlan()
        recv_items = {int(i) for msgs in transport.recv.values() for pieces in msgs for i in pieces}
        send_items = {int(i) for pieces, _ in transport.send for i in pieces}
        job = ReadJob(plan, planner, send_items, chunk_meta=self._chunk_meta, storage_data=self.storage_data,
                      forced=self._forced, stage_bytes=self.stage_bytes,
                      buffers=BUFFERS_PER_THREAD * max(1, self.thread_count), stats=self.stats)
        error: BaseException | None = None
        try:
            self._read_local(job, recv_items)
        except Exception as e:  # any failure (checksum, missing file, I/O): tell the consumers first
            error = e
        sends: dict[int, list[torch.Tensor | None]] = {}
        for pieces, dsts in transport.send:
            # one payload per bundle, shared by all its consumers (a lone piece: its own memory)
            payload = as_bytes_tensor([job.keep[int(i)] for i in pieces]) if error is None else None
            for dst in dsts.tolist():
                sends.setdefault(dst, []).append(payload)
        incoming = {src: [job.incoming(pieces.tolist()) for pieces in msgs]
                    for src, msgs in transport.recv.items()}
        group = p2p_group(transport.ranks) if transport.ranks else None
        failed = exchange(sends, incoming, ok=error is None, group=group)
        if job.pool is not None:  # the one wait for device copies in flight
            job.pool.drain()
            self.stats.staged_bytes = job.pool.stats.staged_bytes
            self.stats.staging_buffers = job.pool.stats.allocated
            self.stats.staging_waits = job.pool.stats.waits
        self.stats.seconds = time.perf_counter() - t0
        if error is not None:
            raise error
        if failed:
            raise UCPError(
                f"rank(s) {failed} failed reading checkpoint data this rank needs (see their errors)",
                hint="the reading rank reports the cause (e.g. a checksum mismatch)",
            )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- local reads -------------------------------------------------------------------------------

    def _read_local(self, job: ReadJob, skip: set[int]) -> None:
        """Read every item not received from another rank: files in parallel, chunks of a file
        in offset order; objects are delivered on this thread (planner sinks are not locked)."""
        work = sorted(self._by_file(self._local_items(job, skip)).items())
        if self.thread_count > 1 and len(work) > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(work))) as pool:
                for fut in [pool.submit(self._read_file, job, rel, cs) for rel, cs in work]:
                    fut.result()
        else:
            for rel, cs in work:
                self._read_file(job, rel, cs)
        for item, data in job.objects:
            job.deliver(item, data, None)

    def _local_items(self, job: ReadJob, skip: set[int]) -> list[ReadItem]:
        """The items this rank reads itself; a large item for a staged target (planners other than
        ours do not cut them) becomes sub-boxes that fit a staging buffer."""
        out: list[ReadItem] = []
        for i, item in enumerate(job.plan.items):
            if i in skip:
                continue
            if item.type == LoadItemType.BYTE_IO or i in job.send or job.item_nbytes(item) <= self.stage_bytes:
                out.append(item)
                continue
            staged = lambda it: needs_staging(job.planner.resolve_tensor(it), self._forced)  # noqa: E731
            for sub in split_reads([item], job.itemsize, staged, self.stage_bytes):
                job.positions[id(sub)] = i
                out.append(sub)
        return out

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
            with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as f:
                self._check_size(f, rel, atoms)
                for c in cs:
                    if c.info is None:
                        self._read_object(f, rel, c, job)
                    else:
                        self._read_chunk(f, rel, c, job)
        except FileNotFoundError as e:
            if isinstance(e, UCPError):
                raise
            raise MissingFileError(
                f"checkpoint file {rel} is missing from {self.path} (it holds {_names(atoms)})",
                atom=atoms[0], saved=rel,
                hint="the checkpoint is incomplete (a partial copy?); copy the whole folder again",
            ) from None

    def _read_object(self, f: Any, rel: str, c: _Chunk, job: ReadJob) -> None:
        info = self.storage_data[c.index]
        data = self._pread(f, info.offset, info.length, c.index)
        entry = self._crc.get(item_key(c.index)) if self.verify_checksums else None
        if entry is not None:
            self._checker.verify(data, 0, entry[1], rel, c.index)
        elif self.verify_checksums and self._crc and int(self._io.get("version", 1)) >= 2:
            raise CorruptCheckpointError(f"object '{c.index.fqn}' has no checksum in the checkpoint's I/O table",
                                         atom=c.index.fqn, hint="the checkpoint's tables are damaged")
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
        grids = {id(item): box_grid(record.shape, record.itemsize, item.storage_offsets, item.lengths)
                 for item in c.items}
        crcs = self._crc.get(item_key(c.index), [None, []])[1] if self.verify_checksums else []
        base = info.offset + record.data_offset
        fd = regular_fd(f)
        if fd is not None and any(g.nruns > 1 for g in grids.values()):
            self._read_mapped(fd, rel, c, grids, base, record, crcs, job)
            return
        runs = {k: (g.starts(), g.run) for k, g in grids.items()}
        total = sum(g.nbytes for g in grids.values())
        starts = np.concatenate([st for st, _ in runs.values()])
        lens = np.concatenate([np.full(len(st), n, dtype=np.int64) for st, n in runs.values()])
        intervals = merge_intervals(starts, lens) if len(c.items) > 1 or crcs else None
        disjoint = intervals is None or sum(n for _, n in intervals) == total
        if disjoint and (not crcs or all(len(runs[id(it)][0]) == 1 for it in c.items)):
            self._read_direct(f, rel, c, runs, base, record, crcs, job)
        else:
            self._read_union(f, rel, c, runs, intervals, base, record, crcs, job)

    def _read_direct(self, f: Any, rel: str, c: _Chunk, runs: dict[int, tuple[np.ndarray, int]], base: int,
                     record: TensorRecord, crcs: list[int], job: ReadJob) -> None:
        """Each item's runs straight into its destination; a single-run item verifies the blocks it
        touches from that memory, reading only their edges."""
        for item in c.items:
            st, n = runs[id(item)]
            target, mv = job.destination(item, record, len(st) * n)
            self._pread_runs(f, base, st, n, mv, c.index)
            if crcs:
                self._checker.verify_span(lambda off, n: self._pread(f, off, n, c.index), base, int(st[0]), mv, crcs,
                                          record.nbytes, rel, c.index)
            job.finish(item, target, mv, record)

    def _read_union(self, f: Any, rel: str, c: _Chunk, runs: dict[int, tuple[np.ndarray, int]],
                    intervals: list[tuple[int, int]], base: int, record: TensorRecord, crcs: list[int],
                    job: ReadJob) -> None:
        """Items sharing bytes, or runs to verify: the union read once (whole checksum blocks)."""
        if crcs:
            intervals = blocks_touching(intervals, record.nbytes, self._block)
        buffers = []
        for start, length in intervals:
            buf = self._pread(f, base + start, length, c.index)
            if crcs:
                self._checker.verify(buf, start, crcs, rel, c.index)
            buffers.append((start, buf))
        bstarts = [b[0] for b in buffers]
        for item in c.items:
            st, n = runs[id(item)]
            data = gather_runs(buffers, bstarts, st, n)
            job.keep_if_sent(item, data)
            job.deliver(item, data, record.dtype)

    def _read_mapped(self, fd: int, rel: str, c: _Chunk, grids: dict[int, BoxGrid], base: int,
                     record: TensorRecord, crcs: list[int], job: ReadJob) -> None:
        """Strided boxes of a local file: map a bounded window of the chunk at a time and copy the
        runs out with one strided copy (a syscall per run costs more than the bytes). Blocks the
        window touches are verified once each, from the mapping."""
        size = os.fstat(fd).st_size
        if base + record.nbytes > size:
            raise TruncatedFileError(f"checkpoint file {rel} ends at byte {size}, before the data of '{c.index.fqn}' "
                           f"(needed up to {base + record.nbytes}): the file is truncated", atom=c.index.fqn,
                           hint="the checkpoint is incomplete or damaged; restore the file from a good copy")
        if crcs and self._read_tiles(fd, rel, c, base, record, job):
            return
        B = self._block
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
                        blk = window[b * B - lo:min((b + 1) * B, record.nbytes) - lo]
                        self._checker.check(b, block_hash(blk, self._algo), crcs, rel, c.index)
                        verified.add(b)
                gather_grid(window, lo, piece, out[done:done + piece.nbytes])
                done += piece.nbytes
                del window
            job.finish(item, target, mv, record)
        if crcs:
            nbytes = sum(min((b + 1) * B, record.nbytes) - b * B for b in verified)
        elif len(c.items) == 1:
            nbytes = next(iter(grids.values())).nbytes
        else:
            gs = list(grids.values())
            merged = merge_intervals(np.concatenate([g.starts() for g in gs]),
                                     np.concatenate([np.full(g.nruns, g.run, dtype=np.int64) for g in gs]))
            nbytes = sum(n for _, n in merged)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += 1
            self.stats.items.append(item_key(c.index))

    def _read_tiles(self, fd: int, rel: str, c: _Chunk, base: int, record: TensorRecord, job: ReadJob) -> bool:
        """Strided boxes verified by the chunk's tile sums (reading the tiles they touch, not whole
        checksum blocks); False when the chunk has none or a box does not take whole dims >= 2."""
        entry = self._crc.get(item_key(c.index))
        tiles = entry[3] if entry is not None and len(entry) > 3 else None
        if not tiles:
            return False
        grid = saved_tile_grid(tiles, record.shape, record.itemsize, c.index)
        boxes = plan_tiled(grid, record.shape, [(it.storage_offsets, it.lengths) for it in c.items])
        if boxes is None:
            return False
        sums, verified, nbytes = tiles[2], set(), 0

        def check(t: int, got: int) -> None:
            self._checker.check_tile(t, got, sums, rel, c.index)

        for item, box in zip(c.items, boxes):
            n = math.prod(box.sizes) * record.itemsize
            target, mv = job.destination(item, record, n)
            out = np.frombuffer(mv, dtype=np.uint8) if n else np.empty(0, dtype=np.uint8)
            nbytes += read_tiled(fd, base, record.shape, record.itemsize, grid, box, out, verified, check,
                                 HASHES[self._algo or ""])
            job.finish(item, target, mv, record)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.ranges += 1
            self.stats.items.append(item_key(c.index))
        return True

    def _fallback(self, f: Any, c: _Chunk, info: Any, job: ReadJob) -> None:
        """DCP's path: deserialize the whole item, then narrow."""
        self.stats.fallbacks += 1
        raw = self._pread(f, info.offset, info.length, c.index)
        stream = self.transforms.transform_load_stream(c.items[0], info.transform_descriptors or (), io.BytesIO(raw))
        data = stream.read() if not stream.seekable() else stream
        try:
            tensor = torch.load(data if isinstance(data, io.IOBase) else io.BytesIO(data), map_location="cpu",
                                weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} is not a "
                "plain tensor: decoding it could run code", atom=c.index.fqn,
                hint="the checkpoint was crafted or damaged; do not load it") from None
        except Exception as e:
            raise CorruptCheckpointError(
                f"the record of '{c.index.fqn}' chunk {list(c.index.offset or ())} in {info.relative_path} does not "
                f"parse ({type(e).__name__}: {e})", atom=c.index.fqn,
                hint="the checkpoint file is damaged; restore it from a good copy") from None
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"the record of '{c.index.fqn}' holds a {type(tensor).__name__}, not a tensor",
                                         atom=c.index.fqn)
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
                atom=atoms[0], saved=want, wanted=have,
                hint="the checkpoint is damaged (an interrupted copy?); restore the file from a good copy",
            )

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
            rec = parse_tensor_record(cast(io.IOBase, _create_file_view(f, info.offset, info.length)))
            with self._lock:
                self.stats.ranges += 1
        with self._lock:
            self._records[index] = rec
        return rec

    def _pread_runs(self, f: Any, base: int, starts: np.ndarray, run: int, out: memoryview,
                    index: MetadataIndex) -> None:
        """Read equal-length runs at ``base + starts`` into consecutive parts of ``out``."""
        if len(starts) == 1 or not hasattr(f, "fileno"):
            for k, s0 in enumerate(starts.tolist()):
                self._pread_into(f, base + s0, out[k * run:(k + 1) * run], index)
            return
        fd = f.fileno()
        pos = 0
        for s0 in (starts + base).tolist():
            got = os.preadv(fd, [out[pos:pos + run]], s0)
            if got != run:
                self._pread_into(f, s0, out[pos:pos + run], index)  # short read: finish the slow way
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
                raise TruncatedFileError(f"checkpoint file ended early reading '{index.fqn}': the file is truncated",
                                         atom=index.fqn, hint="restore the file from a good copy")
            n += more
        self._note(index, len(out))

    def _note(self, index: MetadataIndex, nbytes: int) -> None:
        with self._lock:
            self.stats.bytes_read += int(nbytes)
            self.stats.ranges += 1
            self.stats.items.append(item_key(index))



_UNVERIFIED = {
    "none": "checkpoint {path} has no checksums: nothing this load reads is verified. Save with "
            "ucp_dcp.save(...) or storage_writer=UCPFileSystemWriter(path) to get them (and an atomic commit).",
    "partial": "checkpoint {path} was written by an older ucp_dcp: tensor data is verified, its metadata "
               "and non-tensor values are not. Save it again with this version to protect them.",
}


def _names(atoms: list[str]) -> str:
    return ", ".join(f"'{a}'" for a in atoms[:3]) + (f" and {len(atoms) - 3} more" if len(atoms) > 3 else "")
