"""``UCPFileSystemWriter``: DCP's file format, plus what ranged reads and checksums need.

Each item is still one ``torch.save`` zip inside a ``__<rank>_<n>.distcp`` file, and
``Metadata.storage_data`` still maps every ``MetadataIndex`` to DCP's ``_StorageInfo``, so the stock
``FileSystemReader``, default planner and ``dcp_to_torch_save`` read these checkpoints. In addition,
under the reserved index ``MetadataIndex("__ucp_io__")`` (builtins only), it records per tensor item
where its elements start inside the item and a CRC32 per 1 MiB block of tensor bytes. Tensors are
written row-major and compact, so any box of a chunk is a set of byte runs.

It also removes a stale ``.metadata`` before writing into an existing checkpoint folder: a save that
dies half-way must not leave the old metadata pointing at half-overwritten files.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from torch.futures import Future
from typing import Any

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

from .io_format import BLOCK, IO_KEY, block_checksums, parse_tensor_record

__all__ = ["UCPFileSystemWriter", "item_key"]


def item_key(index: MetadataIndex) -> str:
    """Builtins key of a stored item in the ``__ucp_io__`` table."""
    return f"{index.fqn}|{','.join(map(str, index.offset or ()))}"


class UCPFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that also records tensor data offsets and block checksums.

    Args:
        path: checkpoint folder.
        checksums: compute CRC32 per 1 MiB block of tensor bytes (verified by
            ``UCPFileSystemReader``). Costs one CRC pass over the data at save.
        thread_count: writer threads (one file per thread and rank).
        sync_files: fsync every file (DCP's default).
    """

    def __init__(self, path: str | os.PathLike, *, checksums: bool = True, thread_count: int = 1,
                 sync_files: bool = True, **kwargs: Any) -> None:
        super().__init__(path, thread_count=thread_count, sync_files=sync_files, **kwargs)
        self.checksums = checksums

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
        with self.fs.create_stream(path, "wb") as stream:
            # bytes first, like DCP; then tensors, largest first is irrelevant here
            for item in sorted(items, key=lambda it: it.type != WriteItemType.BYTE_IO):
                offset = stream.tell()
                data = planner.resolve_data(item)
                extra = None
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    buf, extra = self._serialize(data)
                    stream.write(buf.getbuffer())
                length = stream.tell() - offset
                info = _StorageInfo(name, offset, length)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=(info, extra)))
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    pass
        return results

    def _serialize(self, tensor: torch.Tensor) -> tuple[io.BytesIO, list[Any]]:
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.contiguous().clone()  # compact row-major storage: boxes become byte runs
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        rec = parse_tensor_record(buf)
        data_offset = rec.data_offset if rec is not None else -1
        crcs: list[int] = []
        if self.checksums and rec is not None and rec.contiguous:
            view = buf.getbuffer()[data_offset:data_offset + t.nbytes]
            crcs = block_checksums(view, BLOCK)
            del view
        return buf, [data_offset, crcs]

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
        io_info = {"version": 1, "block": BLOCK, "algo": "crc32" if self.checksums else None, "items": table}
        plain.append([WriteResult(index=MetadataIndex(IO_KEY), size_in_bytes=0, storage_data=io_info)])
        super().finish(metadata, plain)
