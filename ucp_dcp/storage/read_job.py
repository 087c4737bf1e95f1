"""One ``read_data`` call's state, and where the bytes it reads go.

A read item's bytes land in the target tensor's own memory when it can take them as they are; a
device target's go through a staging buffer and a non-blocking copy; anything else through a
packed buffer and a converting copy. The planner then commits the item. Pieces other ranks need
are kept for the exchange; pieces from other ranks are received here too.
"""

from __future__ import annotations

import io
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .._compat import narrow_tensor_by_index
from ..errors import UCPError
from ..planning.device import needs_staging, split_box
from ..progress import size_text
from .format import TensorRecord
from .staging import BUFFERS_PER_THREAD, StagingPool, to_device
from .transport import Incoming

__all__ = ["ReadStats", "ReadJob", "items_nbytes"]


@dataclass(repr=False)
class ReadStats:
    """What one rank requested from storage during the last ``read_data``. Its ``repr`` is a one-line summary
    (totals; the per-item list stays in :attr:`items`)."""

    bytes_read: int = 0
    """Bytes requested from storage (byte ranges, incl. checksum widening and fallbacks)."""
    ranges: int = 0
    """Read calls issued."""
    items: list[str] = field(default_factory=list)
    """Storage items (``fqn|offsets``) this rank read bytes of."""
    bytes_received: int = 0
    """Bytes received from other ranks instead of storage."""
    fallbacks: int = 0
    """Items read whole, DCP-style (transforms or foreign records)."""
    seconds: float = 0.0
    """Wall time of ``read_data`` (reads, verification and transfers; not DCP's planning collectives)."""
    staged_bytes: int = 0
    """Bytes that reached their targets through staging buffers (device targets, or forced)."""
    staging_buffers: int = 0
    """Staging buffers allocated (each ``stage_bytes``; pinned for CUDA targets)."""
    staging_waits: int = 0
    """Times a read waited for a device copy to free a staging buffer."""
    tasks: int = 0
    """Reading tasks (a file, or a run of whole chunks of one) spread over the reading threads."""
    plan_cached: bool = False
    """This rank planned nothing: its load plan and read-once summary came from this process's plan cache
    (``cache_plans``, :mod:`ucp_dcp.planning.plan_cache`) and DCP's plan gather carried a marker of them."""
    global_plan_cached: bool = False
    """The coordinator answered with a marker of this rank's cached read-once plan (nothing re-planned)."""
    files: int = 0
    """Data files this rank read from."""
    bytes_loaded: int = 0
    """Bytes of this rank's read items that reached their targets, from storage or other ranks: what it needed."""

    def __repr__(self) -> str:
        # a load of 10,000 tensors listed every item (110 KB); the totals say what a person looks for
        ratio = f" ({self.bytes_read / self.bytes_loaded:.2f}x)" if self.bytes_loaded else ""
        parts = [
            f"{size_text(self.bytes_loaded)} needed, {size_text(self.bytes_read)} read{ratio} in {self.ranges} "
            f"range(s) of {len(self.items)} item(s) from {self.files} file(s)",
        ]
        if self.bytes_received:
            parts.append(f"{size_text(self.bytes_received)} received from other ranks")
        if self.fallbacks:
            parts.append(f"{self.fallbacks} item(s) read whole")
        if self.staged_bytes:
            parts.append(
                f"{size_text(self.staged_bytes)} staged through {self.staging_buffers} buffer(s), "
                f"{self.staging_waits} wait(s)"
            )
        if self.plan_cached or self.global_plan_cached:
            parts.append("plan cached" + (" (global plan too)" if self.global_plan_cached else ""))
        return f"ReadStats({'; '.join(parts)}; {self.seconds:.2f} s)"

    __str__ = __repr__


def items_nbytes(
    items: list[ReadItem],
    chunk_meta: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]],
    storage_data: dict[MetadataIndex, Any],
) -> int:
    """Bytes the read items need (a tensor box's at its saved dtype, an object's stored length)."""
    return sum(
        int(storage_data[it.storage_index].length)
        if it.type == LoadItemType.BYTE_IO
        else math.prod(it.lengths) * chunk_meta[it.storage_index][0].itemsize
        for it in items
    )


@dataclass
class _Staged:
    """A staging buffer being filled for a target that cannot take host writes."""

    target: torch.Tensor
    buf: torch.Tensor


@dataclass
class ReadJob:
    """One ``read_data`` call: the items, the planner that resolves them, and the pieces other
    ranks need (kept after they are read, for the exchange)."""

    plan: LoadPlan
    planner: LoadPlanner
    send: set[int]
    """Positions (in ``plan.items``) of items this rank reads for other ranks too."""
    keep: dict[int, bytes | memoryview] = field(default_factory=dict)
    """Bytes of those items, by position."""
    positions: dict[int, int] = field(default_factory=dict)
    """``id(item) -> position``; sub-items of a split item map to their item's position."""
    objects: list[tuple[ReadItem, memoryview]] = field(default_factory=list)
    """Object items read by the file threads, delivered on the calling thread."""
    chunk_meta: dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """Saved dtype and shape of every chunk."""
    storage_data: dict[MetadataIndex, Any] = field(default_factory=dict)
    """The checkpoint's storage entries (sizes of saved objects)."""
    forced: bool = False
    """Stage CPU targets too (``staging="always"``)."""
    stage_bytes: int = 16 << 20
    """Size of one staging buffer."""
    buffers: int = BUFFERS_PER_THREAD
    """Most staging buffers in the pool."""
    transforms: Any = None
    """The reader's stream transforms (DCP's, from its ``_extension_registry``): an object item saved through
    some (its storage entry's ``transform_descriptors``) is decoded by them before the planner gets its bytes,
    as DCP's reader does. Objects travel between ranks as stored, each rank decoding what it delivers."""
    stats: ReadStats = field(default_factory=ReadStats)
    pool: StagingPool | None = None
    """Created on the first staged target (pinned for CUDA targets)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # by identity: the coordinator's answer names pieces by their position in the plan, and ReadItems
        # with equal fields (one chunk feeding one box twice) are distinct reads
        self.positions.update((id(it), i) for i, it in enumerate(self.plan.items))

    def sending(self, item: ReadItem) -> bool:
        return self.positions[id(item)] in self.send

    def keep_if_sent(self, item: ReadItem, data: bytes | memoryview) -> None:
        if self.sending(item):
            self.keep[self.positions[id(item)]] = data

    def itemsize(self, item: ReadItem) -> int:
        return self.chunk_meta[item.storage_index][0].itemsize

    def item_nbytes(self, item: ReadItem) -> int:
        if item.type == LoadItemType.BYTE_IO:
            return int(self.storage_data[item.storage_index].length)
        dtype, _ = self.chunk_meta[item.storage_index]
        return math.prod(item.lengths) * dtype.itemsize

    def destination(
        self, item: ReadItem, record: TensorRecord, nbytes: int
    ) -> tuple[torch.Tensor | _Staged | None, memoryview]:
        """Where an item's bytes go: the target tensor's own memory when it can take them as they
        are (same dtype, contiguous; a piece also sent to other ranks is sent from there); for a
        device target a staging buffer; else a packed buffer."""
        target = self.planner.resolve_tensor(item).detach()
        if needs_staging(target, self.forced):
            if (
                self.sending(item) or not target.numel() or nbytes > self.stage_bytes
            ):  # kept for the exchange: own memory
                return None, memoryview(bytearray(nbytes))
            # a staging buffer is reused once its copy's event completes, so reading the next item overlaps
            # this one's host-to-device copy (storage/staging)
            buf = self.staging_pool(target).acquire()
            return _Staged(target, buf), memoryview(buf[:nbytes].numpy())
        # a conjugate/negative view's memory holds other bytes than its values (stock planners hand
        # those targets over as they are): copy_ into it from a buffer, as DCP's reader does
        viewed = target.is_conj() or target.is_neg()
        if target.dtype == record.dtype and target.is_contiguous() and target.numel() and not viewed:
            return target, memoryview(target.view(-1).view(torch.uint8).numpy())
        return None, memoryview(bytearray(nbytes))

    def finish(
        self, item: ReadItem, target: torch.Tensor | _Staged | None, mv: memoryview, record: TensorRecord
    ) -> None:
        # kept before the commit: a piece other ranks need is sent from the bytes as read, whatever the
        # planner's commit_tensor does to the target after
        self.keep_if_sent(item, mv)
        if isinstance(target, _Staged):
            assert self.pool is not None
            to_device(self.pool, target.buf, record.dtype, tuple(item.lengths), target.target)
            self.planner.commit_tensor(item, target.target)
            self.loaded(math.prod(item.lengths) * record.itemsize)
        elif target is not None:
            self.planner.commit_tensor(item, target)
            self.loaded(math.prod(item.lengths) * record.itemsize)
        else:
            self.deliver(item, mv, record.dtype)

    def deliver(self, item: ReadItem, data: Any, dtype: torch.dtype | None) -> None:
        """Copy packed bytes of an item into its target (converting dtype) and commit it."""
        if item.type == LoadItemType.BYTE_IO:
            self.planner.load_bytes(item, io.BytesIO(self.decoded(item, data)))
            self.loaded(memoryview(data).nbytes)
            return
        if dtype is None:
            dtype, _ = self.chunk_meta[item.storage_index]
        src = (
            torch.frombuffer(data, dtype=dtype).view(tuple(item.lengths))
            if len(data)
            else torch.empty(tuple(item.lengths), dtype=dtype)
        )
        # DCP's order for each item, as its own reader keeps it: resolve_tensor, copy into it, commit_tensor (a
        # planner may hand out scratch memory that only its commit compares or folds into the target)
        target = self.planner.resolve_tensor(item).detach()
        if target.size() != src.size():
            raise UCPError(
                f"read {tuple(src.size())} for a target of {tuple(target.size())} ({item.storage_index.fqn})"
            )
        if needs_staging(target, self.forced) and len(data):
            self.stage_copy(data, dtype, tuple(item.lengths), target)
        else:
            target.copy_(src)
        self.planner.commit_tensor(item, target)
        self.loaded(src.numel() * src.element_size())

    def loaded(self, nbytes: int) -> None:
        """``nbytes`` of this rank's items reached their targets (file threads call it side by side)."""
        with self.lock:  # a += from several threads is a read-modify-write: without the lock, counts are lost
            self.stats.bytes_loaded += nbytes

    def decoded(self, item: ReadItem, data: bytes | memoryview) -> bytes:
        """An object item's serialized bytes: those stored, with the item's stream transforms undone by DCP's
        machinery (``FileSystemReader.read_data``'s own ``transform_load_stream``); as stored when it has none."""
        descriptors = getattr(self.storage_data.get(item.storage_index), "transform_descriptors", None)
        if not descriptors or self.transforms is None:
            return bytes(data)
        return self.transforms.transform_load_stream(item, descriptors, io.BytesIO(data)).read(-1)

    def stage_copy(self, data: Any, dtype: torch.dtype, lengths: tuple[int, ...], target: torch.Tensor) -> None:
        """Copy packed host bytes of a box into a staged target, one staging buffer at a time."""
        pool = self.staging_pool(target)
        itemsize = dtype.itemsize
        src = np.frombuffer(data, dtype=np.uint8)
        strides = [math.prod(lengths[d + 1 :]) for d in range(len(lengths))]
        for offs, lens in split_box(lengths, itemsize, pool.buffer_bytes):
            start = sum(o * s for o, s in zip(offs, strides)) * itemsize
            n = math.prod(lens) * itemsize
            buf = pool.acquire()
            buf[:n].numpy()[:] = src[start : start + n]
            to_device(pool, buf, dtype, lens, narrow_tensor_by_index(target, offs, lens))

    def staging_pool(self, target: torch.Tensor) -> StagingPool:
        with self.lock:
            if self.pool is None:  # pinned only for CUDA targets (a CPU-only torch cannot pin)
                self.pool = StagingPool(self.stage_bytes, self.buffers, pin=target.device.type == "cuda")
            return self.pool

    def incoming(self, pieces: list[int]) -> Incoming:
        """How to receive one bundle: a lone tensor piece straight into its target when the target
        takes the saved bytes as they are, anything else through a buffer of the bundle's size."""
        items = [self.plan.items[i] for i in pieces]
        sizes = [self.item_nbytes(it) for it in items]
        target = None
        if len(items) == 1 and items[0].type != LoadItemType.BYTE_IO and sizes[0]:
            t = self.planner.resolve_tensor(items[0]).detach()
            if (
                t.dtype == self.chunk_meta[items[0].storage_index][0]
                and t.is_contiguous()
                and not needs_staging(t, self.forced)
            ):
                target = t

        def buffer() -> torch.Tensor:
            return (
                target.view(-1).view(torch.uint8) if target is not None else torch.empty(sum(sizes), dtype=torch.uint8)
            )

        def deliver(buf: torch.Tensor) -> None:
            self.stats.bytes_received += buf.numel()
            if target is not None:
                self.planner.commit_tensor(items[0], target)
                self.loaded(buf.numel())
                return
            mv = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
            pos = 0
            for it, n in zip(items, sizes):
                self.deliver(it, mv[pos : pos + n], None)
                pos += n

        return Incoming(sum(sizes), buffer, deliver)
