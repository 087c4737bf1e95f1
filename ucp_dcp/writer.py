"""``UCPFileSystemWriter``: DCP's file format, plus what ranged reads and checksums need.

Each item is still one ``torch.save`` zip inside a ``__<rank>_<n>.distcp`` file, and
``Metadata.storage_data`` still maps every ``MetadataIndex`` to DCP's ``_StorageInfo``, so the stock
``FileSystemReader``, default planner and ``dcp_to_torch_save`` read these checkpoints. In addition,
under the reserved index ``MetadataIndex("__ucp_io__")`` (builtins only), it records per tensor item
where its elements start inside the item and a checksum (XXH3-64) per 1 MiB block of tensor bytes. Tensors are
written row-major and compact, so any box of a chunk is a set of byte runs.

It also removes a stale ``.metadata`` before writing into an existing checkpoint folder: a save that
dies half-way must not leave the old metadata pointing at half-overwritten files.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from torch.futures import Future
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .io_format import BLOCK, DEFAULT_HASH, IO_KEY, block_checksums

__all__ = ["UCPFileSystemWriter", "item_key"]


class _Tracked(io.RawIOBase):
    """A write-only view of a stream that counts bytes and notes where the expected tensor bytes
    were written (``torch.save`` writes a storage record's data in one call)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.pos = stream, 0
        self._expect: memoryview | None = None
        self._addr = 0
        self.found: int | None = None

    def writable(self) -> bool:
        return True

    def expect(self, data: memoryview) -> None:
        self._expect, self.found = data, None
        self._addr = _address(data)

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        if self._expect is not None and self.found is None and n == len(self._expect) and n:
            # torch.save hands the storage memory itself to write(): match it by address, or by
            # content for small copies
            if _address(mv) == self._addr or (n <= 1 << 16 and mv.tobytes() == self._expect.tobytes()):
                self.found = self.pos
        self.stream.write(mv)
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


def item_key(index: MetadataIndex) -> str:
    """Builtins key of a stored item in the ``__ucp_io__`` table."""
    return f"{index.fqn}|{','.join(map(str, index.offset or ()))}"


class UCPFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that also records tensor data offsets and block checksums.

    Args:
        path: checkpoint folder.
        checksums: compute a checksum per 1 MiB block of tensor bytes (verified by
            ``UCPFileSystemReader``). Costs one hash pass over the data at save, overlapped with the
            writes and the fsync.
        thread_count: writer threads (one file per thread and rank).
        sync_files: fsync every file (DCP's default).
        zip_crc32: let ``torch.save`` compute the CRC32 of every zip record. Default: only when
            ``checksums`` is off. The block checksums already cover every tensor byte and
            ``torch.load`` never checks the zip CRC, which costs ~0.17 s of CPU per GiB. torch's
            switch is process-wide, so while a save writes, other ``torch.save`` calls of the
            process skip it too (their files still load; only ``unzip -t`` would complain).
    """

    def __init__(self, path: str | os.PathLike, *, checksums: bool = True, thread_count: int = 1,
                 sync_files: bool = True, zip_crc32: bool | None = None, **kwargs: Any) -> None:
        super().__init__(path, thread_count=thread_count, sync_files=sync_files, **kwargs)
        self.checksums = checksums
        self.zip_crc32 = (not checksums) if zip_crc32 is None else zip_crc32

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # the coordinator runs this before any rank writes: an old .metadata would otherwise
        # describe files that this save is about to overwrite
        meta = self._get_metadata_path()
        if self.fs.exists(meta):
            self.fs.rm_file(meta)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_plan: _StoragePrefix = plan.storage_data
        work: queue.Queue = queue.Queue()
        buckets = _split_by_size_and_type(self.thread_count, plan.items) if self.single_file_per_rank else [
            [it] for it in plan.items]
        for i, bucket in enumerate(buckets):
            name = f"{storage_plan.prefix}{i}{DEFAULT_SUFFIX}"
            work.put((self.fs.concat_path(self.path, name), name, bucket))
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

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(1, min(self.thread_count, len(buckets)))]
        with _zip_crc32(self.zip_crc32):
            for t in threads:
                t.start()
            worker()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, path: Any, name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        results = []
        with self.fs.create_stream(path, "wb") as stream, ThreadPoolExecutor(1) as hash_pool:
            out = _Tracked(stream)
            # bytes first, like DCP
            for item in sorted(items, key=lambda it: it.type != WriteItemType.BYTE_IO):
                offset = out.pos
                data = planner.resolve_data(item)
                extra = None
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer())
                else:
                    extra = self._write_tensor(out, data, hash_pool)
                info = _StorageInfo(name, offset, out.pos - offset)
                results.append(WriteResult(index=item.index, size_in_bytes=out.pos - offset, storage_data=(info, extra)))
            if self.sync_files:
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
        return results

    def _write_tensor(self, out: "_Tracked", tensor: torch.Tensor, hash_pool: ThreadPoolExecutor) -> list[Any]:
        """``torch.save`` straight into the file (DCP's item format); the tensor bytes' offset is
        taken from the write that carried them. Returns ``[data_offset, sums]`` where ``sums`` is a
        future: they are computed concurrently from the tensor's own memory (which the planner
        keeps alive until the write finishes)."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.contiguous().clone()  # compact row-major storage: boxes become byte runs
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        sums = hash_pool.submit(block_checksums, raw, BLOCK, DEFAULT_HASH) if self.checksums and t.numel() else None
        start = out.pos
        out.expect(raw)
        torch.save(t, out)
        data_offset = out.found - start if out.found is not None else -1
        return [data_offset, sums if sums is not None else []]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        table: dict[str, Any] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            out = []
            for wr in rank_results:
                info, extra = wr.storage_data if isinstance(wr.storage_data, tuple) else (wr.storage_data, None)
                if extra is not None:
                    table[item_key(wr.index)] = extra
                out.append(WriteResult(index=wr.index, size_in_bytes=wr.size_in_bytes, storage_data=info))
            plain.append(out)
        io_info = {"version": 1, "block": BLOCK, "algo": DEFAULT_HASH if self.checksums else None, "items": table}
        plain.append([WriteResult(index=MetadataIndex(IO_KEY), size_in_bytes=0, storage_data=io_info)])
        super().finish(metadata, plain)
