"""``UCPFileSystemWriter``: DCP's file format, plus checksums of every byte and an atomic commit.

Each item is still one ``torch.save`` zip inside a ``.distcp`` file, and ``Metadata.storage_data``
still maps every ``MetadataIndex`` to DCP's ``_StorageInfo``, so the stock ``FileSystemReader``,
default planner and ``dcp_to_torch_save`` read these checkpoints. In addition, under the reserved
index ``MetadataIndex("__ucp_io__")`` (builtins only), it records per tensor item where its
elements start inside the item, a checksum (XXH3-64) per block of tensor bytes (a block of 1 KiB to
1 MiB, a 64th of the item or less: :func:`~ucp_dcp.storage.format.checksum_block`) and one of the item's
other bytes, and per object item checksums of its bytes. Tensors are written row-major and
compact, so any box of a chunk is a set of byte runs.

Data files get names no earlier save used, and the save commits by renaming ``.metadata`` into
place after its integrity sidecar (:mod:`ucp_dcp.storage.commit`): a save that dies never costs the
checkpoint it was replacing.

Kept in one module (about 470 lines once formatted): one writer class whose save steps (prepare, write
with checksums and tile sums, replica comparison, commit) share its per-save state.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import math
import os
import pickle
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    SerializationFormat,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._compat import _split_by_size_and_type, _StorageInfo, _StoragePrefix, fsspec_filesystem, metadata_path
from ..errors import ReplicaMismatchError, StorageAccessError, UCPError
from ..planning.checkpoint_group import mark
from ..planning.device import staging_forced
from ..planning.digests import tensor_bytes
from ..planning.faults import fault_point
from ..planning.handshake import ReplicaCopySource, WriterAcknowledgement
from ..planning.ties import add_alias_keys
from ..progress import CallProgress
from .commit import METADATA, commit, new_token
from .file_ranges import reading_threads
from .format import (
    BLOCK,
    DEFAULT_HASH,
    HASHES,
    IO_KEY,
    IO_VERSION,
    RECORD_ALIGN,
    TABLE_HASH,
    block_checksums,
    checksum_block,
    item_key,
)
from .object_commit import commit_objects
from .object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol
from .sidecar import encode_sidecar
from .staging import HostCopies
from .tiles import ColumnBands, band_boxes, band_chunks, column_bands, tile_entry

__all__ = ["UCPFileSystemWriter"]


def _tensor_bytes(items: list[WriteItem]) -> int:
    """Bytes of the tensor items of a save plan (objects' sizes are known only once they are serialized)."""
    return sum(
        math.prod(it.tensor_data.chunk.sizes) * it.tensor_data.properties.dtype.itemsize
        for it in items
        if it.type != WriteItemType.BYTE_IO and it.tensor_data is not None
    )


def _chunk_bytes(md: Metadata) -> int:
    """Bytes of every tensor chunk a save's metadata lists (what the job's ranks write of tensors)."""
    return sum(
        math.prod(c.sizes) * m.properties.dtype.itemsize
        for m in md.state_dict_metadata.values()
        if isinstance(m, TensorStorageMetadata)
        for c in m.chunks
    )


def _write_error(path: Any, cause: OSError, written: int) -> StorageAccessError:
    """The storage's own failure of a data file write, named (a full disk reads as ``torch.save``'s
    ``unexpected pos`` otherwise). Nothing was committed: the folder's previous checkpoint stands."""
    what = os.strerror(cause.errno) if cause.errno else str(cause)
    hint = (
        "the file system is full: free space (or save to another folder) and save again"
        if cause.errno in (errno.ENOSPC, errno.EDQUOT)
        else "check the folder's file system and permissions, then save again"
    )
    return StorageAccessError(
        f"writing checkpoint file {path} failed after {written} bytes: {what} ({type(cause).__name__}); "
        "this save did not commit, the folder's previous checkpoint (if any) is unchanged",
        saved=str(path),
        hint=hint,
    )


class _Tracked(io.RawIOBase):
    """A write-only view of a stream that counts bytes and notes where the expected tensor bytes
    were written (``torch.save`` writes a storage record's data in one call)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.pos = stream, 0
        self.payload = 0
        """Tensor bytes written (the progress counts these: the plan's sizes are tensor bytes, not zip records)."""
        self._expect: memoryview | None = None
        self.failed: OSError | None = None
        """The storage's error on a write: ``torch.save`` masks it with its own when it closes the record."""
        self._addr = 0
        self.found: int | None = None
        self.frame: Any = None

    def writable(self) -> bool:
        return True

    def expect(self, data: memoryview) -> None:
        """Look for ``data`` among the next writes; hash every other byte written (the item's frame)."""
        self._expect, self.found = data, None
        self._addr = _address(data)
        self.frame = xxhash.xxh3_64()

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if self._expect is not None and self.found is None and n == len(self._expect) and n:
            # torch.save hands the storage memory itself to write(): match it by address, or by
            # content for small copies
            if _address(mv) == self._addr or (n <= 1 << 16 and mv.tobytes() == self._expect.tobytes()):
                self.found = self.pos
        if self.frame is not None and self.found != self.pos:  # every byte but the data's
            self.frame.update(mv)
        try:
            self.stream.write(mv)
        except OSError as e:
            self.failed = e
            raise
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos


_CRC_LOCK = threading.Lock()
_CRC_STATE = {"off": 0, "saved": True}  # writes in flight with torch.save's zip CRC off; the flag before them


@contextmanager
def _zip_crc32(enabled: bool) -> Iterator[None]:
    """Turn torch.save's (process-wide) zip CRC32 off while any such write is in flight."""
    if enabled:
        yield
        return
    from torch.utils.serialization import config

    with _CRC_LOCK:
        if _CRC_STATE["off"] == 0:
            _CRC_STATE["saved"] = config.save.compute_crc32
            config.save.compute_crc32 = False
        _CRC_STATE["off"] += 1
    try:
        yield
    finally:
        with _CRC_LOCK:
            _CRC_STATE["off"] -= 1
            if _CRC_STATE["off"] == 0:
                config.save.compute_crc32 = _CRC_STATE["saved"]


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


@dataclass(frozen=True)
class ReplicaCopy:
    """``WriteResult.storage_data`` of a replicated piece this rank holds but did not write."""

    sums: list[int]
    """Block checksums of this rank's copy (as the writer of the piece computed for its copy)."""


def check_replica_copies(copies: list[tuple[int, WriteResult]], table: dict[str, Any]) -> None:
    """Every rank's copy of a replicated piece must have the written copy's block checksums."""
    bad = []
    for rank, wr in copies:
        written = table.get(item_key(wr.index))
        if written is not None and list(written[1]) != list(wr.storage_data.sums):
            bad.append((wr.index, rank))
    if bad:
        index, rank = bad[0]
        lines = "\n".join(
            f"  {i.fqn}@{list(i.offset or ())}: rank {r}'s copy differs from the written one" for i, r in bad[:10]
        )
        raise ReplicaMismatchError(
            f"{len(bad)} replicated piece(s) differ between the ranks holding them; the save keeps one copy and "
            "would silently drop the others:\n" + lines,
            atom=index.fqn,
            saved=f"rank {rank}'s copy",
            wanted="identical replicas",
            hint="replicas drifted (non-deterministic updates, a rank that missed a step): fix the training, or "
            "pass check_replicas='warn' / 'off' to save anyway",
        )


class UCPFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` with checksums of every byte and an atomic commit, on a local folder or an
    object store (``s3://``, ``gs://``, ``az://``, ``memory://``: :mod:`ucp_dcp.storage.object_commit`).

    The positional parameters are ``FileSystemWriter``'s, in its order and with its meaning (a
    drop-in); ucp_dcp's own options are keyword-only after them.

    Works with any save planner. With one whose plan payload is a
    :class:`~ucp_dcp.planning.handshake.WriterAcknowledgement` (``UCPSavePlanner``) it marks the payload with
    its name and whether it compares replicas, and with a :class:`~ucp_dcp.planning.handshake.ReplicaCopySource`
    planner it compares this rank's copies of replicated pieces with the written ones before the commit.

    Args:
        path: checkpoint folder, or an object-store URL (``s3://bucket/run``; the bucket must exist).
            It may hold a checkpoint already: that one stays loadable until this save commits, and
            its files are removed after.
        single_file_per_rank: as in DCP: one file per rank and writer thread; ``False``: one file
            per item.
        per_thread_copy_ahead: DCP's bound on device bytes copied ahead of the writes (DCP uses it
            only for one-thread CUDA saves). Accepted; it changes nothing written: this writer
            copies device tensors two items ahead of the write instead.
        cache_staged_state_dict: as in DCP (``async_save`` staging keeps its host copy).
        _extensions: DCP's stream transforms: refused (:class:`UCPError`), since checksums and
            ranged reads need the plain records.
        serialization_format: only ``SerializationFormat.TORCH_SAVE`` (DCP's default); safetensors
            is refused (:class:`UCPError`).
        checksums: compute a checksum per block of tensor bytes (1 KiB to 1 MiB, a 64th of the record or
            less), of each item's other bytes and of every object (verified by ``UCPFileSystemReader``
            and ``python -m ucp_dcp verify``). Costs one hash pass over the data at save, overlapped with
            the writes and the fsync.
        thread_count: writer threads (one file per thread and rank).
        sync_files: fsync every file and the folder (DCP's default). Without it a power loss can
            still lose the commit; a process crash cannot.
        overwrite: allow saving into a folder that holds a checkpoint (DCP's default).
        staging: ``"always"`` copies CPU tensors through the device-to-host pipeline too (tests);
            ``"auto"``: only device tensors. None: ``$UCP_DCP_STAGING``.
        zip_crc32: let ``torch.save`` compute the CRC32 of every zip record. Default: only when
            ``checksums`` is off. The block checksums already cover every tensor byte and
            ``torch.load`` never checks the zip CRC, which costs ~0.17 s of CPU per GiB. torch's
            switch is process-wide, so while a save writes, other ``torch.save`` calls of the
            process skip it too (their files still load; only ``unzip -t`` would complain).
        storage_options: for an object-store URL, fsspec's options (``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ...); None: the client's own configuration
            (``AWS_*`` environment variables, config files, instance roles).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        checksums: bool = True,
        zip_crc32: bool | None = None,
        staging: str | None = None,
        storage_options: dict[str, Any] | None = None,
        column_bands: ColumnBands = "store",
    ) -> None:
        proto = object_protocol(path)
        if proto == "file":  # a local folder written as an URL: the local commit (rename, fsync) applies
            path = str(path).split("://", 1)[1]
        elif proto is not None and proto not in OBJECT_PROTOCOLS:
            raise UCPError(
                f"UCPFileSystemWriter commits on local folders (rename) and on object stores (one atomic object "
                f"write: {', '.join(sorted(OBJECT_PROTOCOLS))}); {proto}:// promises neither",
                wanted=str(path),
                hint="save to a local folder and copy it (with its .ucp.*.json sidecar), or to an object store",
            )
        if _extensions:
            raise UCPError(
                "UCPFileSystemWriter does not apply stream transforms (_extensions): its checksums and "
                "ranged reads work on the plain torch.save records",
                wanted=[type(e).__name__ for e in _extensions],
                hint="save without _extensions, or use DCP's FileSystemWriter for transformed files",
            )
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise UCPError(
                f"UCPFileSystemWriter writes DCP's torch.save records only, not {serialization_format}",
                wanted=str(serialization_format),
                hint="leave serialization_format at TORCH_SAVE, or use DCP's "
                "FileSystemWriter / HuggingFaceStorageWriter for safetensors",
            )
        super().__init__(
            path,
            single_file_per_rank,
            sync_files,
            thread_count,
            per_thread_copy_ahead,
            cache_staged_state_dict,
            overwrite,
            _extensions,
            serialization_format,
        )
        self.storage_options = storage_options
        self.store: ObjectStore | None = None
        """The object store the checkpoint goes to (None: a local folder)."""
        if proto is not None and proto != "file":
            self._use_store(str(path))
        self.checksums = checksums
        self._forced = staging_forced(staging)
        self.zip_crc32 = (not checksums) if zip_crc32 is None else zip_crc32
        self.parts_in_flight = max(2, reading_threads())
        self.progress: CallProgress | None = None
        """The call's progress (``ucp_dcp.save`` / ``async_save`` set it): the writer names its phases and, on the
        coordinator, the job's bytes. None: ``write_data`` shows its writing alone."""
        """Parts of a multipart upload in flight at once, per writing thread (object stores)."""
        self.removed: list[str] = []
        """Files the last commit removed (the replaced checkpoint's and stray ones)."""
        if column_bands not in ("store", "always", "off"):
            raise UCPError(f"column_bands={column_bands!r}", wanted="'store', 'always' or 'off'")
        self.column_bands: ColumnBands = column_bands

    def _use_store(self, url: str) -> None:
        self.store = ObjectStore(url, self.storage_options)
        self.fs = fsspec_filesystem()()
        self.path = self.fs.init_path(url, **(self.storage_options or {}))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)
        if checkpoint_id:
            if self.store is not None or object_protocol(checkpoint_id) in OBJECT_PROTOCOLS:
                self._use_store(str(checkpoint_id))
            else:
                self.path = self.fs.init_path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._job_ranks: int | None = None
        if self.progress is not None:
            self.progress.phase("planning")  # an async save's staging (in the caller) is over

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._job_ranks = len(plans)  # the coordinator: write_data gives the progress the job's bytes
        return super().prepare_global_plan(plans)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.store is not None:
            self.store.check_bucket()  # a wrong bucket is one clear error, not a failed upload per rank
            exists = self.store.size(self.store.join(METADATA)) is not None
        else:
            self.fs.mkdir(self.path)
            exists = self.fs.exists(metadata_path(self))
        if not self.overwrite and exists:
            raise UCPError(
                f"a checkpoint exists in {self.path} and overwrite=False",
                hint="save into another folder, or pass overwrite=True",
            )
        if isinstance(plan.planner_data, WriterAcknowledgement):  # UCPSavePlanner's payload: say who writes
            plan = dataclasses.replace(
                plan, planner_data=plan.planner_data.acknowledge_writer(type(self).__name__, self.checksums)
            )
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        mark("save", "writing")
        fault_point("write")
        storage_plan: _StoragePrefix = plan.storage_data
        work: queue.Queue = queue.Queue()
        buckets = (
            _split_by_size_and_type(self.thread_count, plan.items)
            if self.single_file_per_rank
            else [[it] for it in plan.items]
        )
        # names no earlier save used: the checkpoint this save replaces keeps its files until commit
        token = new_token()
        for i, bucket in enumerate(b for b in buckets if b):
            name = f"{storage_plan.prefix}{token}_{i}{DEFAULT_SUFFIX}"
            where = self.store.join(name) if self.store is not None else self.fs.concat_path(self.path, name)
            work.put((where, name, bucket))
        results: list[WriteResult] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def worker() -> None:
            while True:
                try:
                    path, name, items = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    out = self._write_file(path, name, items, planner)
                except BaseException as e:  # surfaced below, on the calling thread
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    results.extend(out)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(1, min(self.thread_count, work.qsize()))]
        # copies of replicated pieces another rank writes: hashed while the writes run, compared in finish()
        copies = planner.replica_copies() if isinstance(planner, ReplicaCopySource) and self.checksums else []
        hasher = ThreadPoolExecutor(1) if copies else None
        # a copy of a piece written as column bands is compared band by band
        copies = [(i, p) for index, t in copies for i, p, _ in self._bands(index, t)]
        copy_sums = (
            [
                # the block the written copy's record gets: the same shape, so the same sums when the bytes agree
                hasher.submit(
                    block_checksums,
                    tensor_bytes(t) if t.numel() else memoryview(b""),
                    checksum_block(t.nbytes),
                    DEFAULT_HASH,
                )
                for _, t in copies
            ]
            if hasher is not None
            else []
        )
        self._streams: list[_Tracked] = []  # every file's tensor bytes, read by the progress printer
        streams = self._streams
        progress = self.progress or CallProgress("save", "writing")
        md = getattr(planner, "metadata", None)  # the coordinator's planner keeps the global metadata (DCP's too)
        if self.progress is not None and getattr(self, "_job_ranks", None) and isinstance(md, Metadata):
            # every chunk of every tensor, each written by one rank: the job's tensor bytes (the ranks' plans
            # reach the writer's prepare_global_plan without their items)
            self.progress.job(_chunk_bytes(md), self._job_ranks or 1)
        with _zip_crc32(self.zip_crc32), progress if self.progress is None else nullcontext():
            progress.counting("writing", _tensor_bytes(plan.items), lambda: sum(t.payload for t in list(streams)))
            for t in threads:
                t.start()
            worker()
            for t in threads:
                t.join()
        if self.progress is not None and not errors:
            progress.phase("commit")  # DCP gathers every rank's write results, then the coordinator commits
        self._streams = []  # the files are closed: nothing to keep (a writer may be pickled for the next save)
        for (index, _), sums in zip(copies, copy_sums):
            results.append(WriteResult(index=index, size_in_bytes=0, storage_data=ReplicaCopy(sums.result())))
        if hasher is not None:
            hasher.shutdown()
        if errors:
            raise errors[0]
        mark("save", "written")
        fault_point("written")  # its files are on disk; DCP gathers the write results for the commit next
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, path: Any, name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        tracked: list[_Tracked] = []
        try:
            return self._write_items(path, name, items, planner, tracked)
        except (OSError, RuntimeError) as e:
            cause = tracked[0].failed if tracked and tracked[0].failed is not None else e
            if cause is e and (isinstance(e, UCPError) or not isinstance(e, OSError)):
                raise
            if isinstance(cause, UCPError):  # the store's own error, under torch.save's
                raise cause from e
            raise _write_error(path, cause, tracked[0].pos if tracked else 0) from e

    def _write_items(
        self, path: Any, name: str, items: list, planner: SavePlanner, tracked: list[_Tracked]
    ) -> list[WriteResult]:
        results = []
        opened = self.store.open_write(path, in_flight=self.parts_in_flight) if self.store else None
        with opened or self.fs.create_stream(path, "wb") as stream, ThreadPoolExecutor(1) as hash_pool:
            out = _Tracked(stream)
            tracked.append(out)
            getattr(self, "_streams", []).append(out)
            # bytes first, like DCP
            for item in (it for it in items if it.type == WriteItemType.BYTE_IO):
                offset = out.pos
                buf = planner.resolve_data(item).getbuffer()
                out.write(buf)
                # objects: checksums of the whole item
                extra = [0, block_checksums(buf, BLOCK, DEFAULT_HASH), None] if self.checksums else None
                info = _StorageInfo(name, offset, out.pos - offset)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=out.pos - offset, storage_data=(info, extra))
                )
            # device tensors reach the host through pinned copies issued ahead of the writes
            tensors = [it for it in items if it.type != WriteItemType.BYTE_IO]
            for item, data in HostCopies(tensors, planner.resolve_data, forced=self._forced):
                for index, piece, origin in self._bands(item.index, data):
                    if out.pos % RECORD_ALIGN:  # unreferenced zeros: the record's data lands aligned
                        out.write(bytes(RECORD_ALIGN - out.pos % RECORD_ALIGN))
                    offset = out.pos
                    extra = self._write_tensor(out, piece, hash_pool)
                    out.payload += piece.nbytes
                    info = _StorageInfo(name, offset, out.pos - offset)
                    storage = (info, extra) if origin is None else (info, extra, origin)
                    results.append(WriteResult(index=index, size_in_bytes=out.pos - offset, storage_data=storage))
            if self.sync_files and self.store is None:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    pass
            # checksums are collected only now, so hashing overlaps the writes and the fsync wait
            for wr in results:
                extra = wr.storage_data[1]
                if extra is not None and not isinstance(extra[1], list):
                    extra[1] = extra[1].result()
                if extra is not None and len(extra) > 3 and hasattr(extra[3], "result"):
                    extra[3] = extra[3].result()
        return results

    def _bands(
        self, index: MetadataIndex, t: torch.Tensor
    ) -> list[tuple[MetadataIndex, torch.Tensor, tuple[tuple[int, ...], tuple[int, ...], int] | None]]:
        """The records a chunk is written as: itself, or its column bands (:mod:`~ucp_dcp.storage.tiles`),
        each with its index and, for bands, the chunk's offsets, sizes and band count (``finish`` cuts the
        metadata's chunk)."""
        on = self.column_bands == "always" or (self.column_bands == "store" and self.store is not None)
        bands = column_bands(tuple(t.shape), t.element_size()) if on and index.offset is not None else 1
        if bands == 1:
            return [(index, t, None)]
        width = t.shape[1] // bands
        return [
            (
                MetadataIndex(index.fqn, offs),
                t.narrow(1, k * width, width),
                (tuple(index.offset), tuple(t.shape), bands),
            )
            for k, (offs, _) in enumerate(band_boxes(index.offset, t.shape, bands))
        ]

    def _write_tensor(self, out: _Tracked, tensor: torch.Tensor, hash_pool: ThreadPoolExecutor) -> list[Any]:
        """``torch.save`` straight into the file (DCP's item format); the tensor bytes' offset is
        taken from the write that carried them. Returns ``[data_offset, sums, frame, tiles, block]`` where
        ``sums`` (one checksum per ``block`` bytes of the tensor) and ``tiles`` are futures: they are computed
        concurrently from the tensor's own memory (which the planner keeps alive until the write finishes);
        ``frame`` is the checksum of the item's other bytes."""
        t = tensor.detach().resolve_conj().resolve_neg()  # a conjugate/negative view: the values it shows
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.contiguous().clone()  # compact row-major storage: boxes become byte runs
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        # a block scaled to the record (a 64th of it, 1 KiB to 1 MiB): a load that needs part of a small record
        # verifies it reading about the bytes it needs, not whole 1 MiB blocks; recorded in the entry
        block = checksum_block(t.nbytes)
        sums = hash_pool.submit(block_checksums, raw, block, DEFAULT_HASH) if self.checksums and t.numel() else None
        # tile sums too (chunks of 2+ dims): a column slice is then verified without reading whole rows
        tiles = (
            hash_pool.submit(tile_entry, raw, tuple(t.shape), t.element_size(), HASHES[DEFAULT_HASH])
            if self.checksums and t.numel() and t.dim() >= 2
            else None
        )
        start = out.pos
        out.expect(raw)
        torch.save(t, out)
        data_offset = out.found - start if out.found is not None else -1
        frame = int(out.frame.intdigest()) if self.checksums else None
        out.frame = None
        return [data_offset, sums if sums is not None else [], frame, tiles, block]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        mark("save", "commit")
        table: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        files: dict[str, int] = {}
        copies: list[tuple[int, WriteResult]] = []
        banded: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]] = {}
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                if isinstance(wr.storage_data, ReplicaCopy):
                    copies.append((rank, wr))
                    continue
                info, extra, *origin = (
                    wr.storage_data if isinstance(wr.storage_data, tuple) else (wr.storage_data, None)
                )
                if origin:  # a column band: the metadata's chunk is cut below
                    offsets, sizes, bands = origin[0]
                    banded[(wr.index.fqn, offsets)] = (sizes, bands)
                if extra is not None:
                    table[item_key(wr.index)] = extra
                storage[wr.index] = info
                files[info.relative_path] = max(files.get(info.relative_path, 0), info.offset + info.length)
        check_replica_copies(copies, table)  # before the commit: a refused save leaves the last checkpoint
        band_chunks(metadata, banded)  # before the aliases: a tied key gets its atom's band chunks
        add_alias_keys(metadata, storage, table)  # tied keys: bytes written once, every name readable
        storage[MetadataIndex(IO_KEY)] = {
            "version": IO_VERSION,
            "block": BLOCK,  # the block of objects' sums; a tensor entry records its own (its fifth element)
            # the digests are DEFAULT_HASH's; the name says their blocks are per record (TABLE_HASH)
            "algo": TABLE_HASH if self.checksums else None,
            "items": table,
        }
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        md_bytes = pickle.dumps(metadata)
        sidecar = encode_sidecar(metadata, md_bytes, files)
        if self.store is not None:
            self.removed = commit_objects(self.store, md_bytes, sidecar, files)
        else:
            self.removed = commit(str(self.path), md_bytes, sidecar, set(files), sync=self.sync_files)
