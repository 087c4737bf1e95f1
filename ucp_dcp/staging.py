"""Host staging between files and device memory: bounded pinned buffers, stream-ordered copies.

A load into device tensors cannot read file bytes straight into the target (``preadv`` and
``mmap`` need host memory), and a save cannot ``torch.save`` a device tensor without a host copy.
Both go through host memory here, with bounds and overlap:

- **Loads**: every read item for a device target is at most ``STAGE_BYTES`` (larger boxes are split
  into sub-boxes whose bytes are contiguous runs of the box, :func:`split_box`). Its bytes land in a
  buffer of a :class:`StagingPool` (a few pinned buffers per reading thread) and go to the device
  with a non-blocking copy on the target device's current stream; the buffer returns to the pool
  with an event, and is reused only once that event completes. Reading the next item overlaps the
  copy, and nothing synchronizes per item: one wait at the end of the read.
- **Saves**: :class:`HostCopies` issues the device-to-host copies of the next items into pinned
  memory while the writer writes the current one.

``UCP_DCP_STAGING=always`` (or ``UCPFileSystemReader(staging="always")``) sends CPU targets through
the same path, so a machine without a GPU exercises every branch a device load takes.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

__all__ = ["STAGE_BYTES", "BUFFERS_PER_THREAD", "STAGING_ENV", "StagingPool", "PoolStats", "HostCopies",
           "split_box", "split_reads", "staging_forced", "needs_staging", "to_device"]

STAGE_BYTES = 16 << 20
"""Size of one staging buffer, and the largest read item for a staged target."""
BUFFERS_PER_THREAD = 3
"""Staging buffers per reading thread: one being filled, two whose copies may still be in flight."""
STAGING_ENV = "UCP_DCP_STAGING"
"""``always``: stage CPU targets too (tests); ``auto`` (default): only non-CPU targets."""


def staging_forced(mode: str | None = None) -> bool:
    """Whether CPU targets go through staging (``mode`` or, when None, ``$UCP_DCP_STAGING``)."""
    mode = mode if mode is not None else os.environ.get(STAGING_ENV, "auto")
    if mode not in ("auto", "always"):
        raise ValueError(f"staging must be 'auto' or 'always', got {mode!r}")
    return mode == "always"


def needs_staging(t: torch.Tensor, forced: bool) -> bool:
    """A target whose bytes cannot be written from the host directly (or any target when forced)."""
    return forced or t.device.type != "cpu"


def split_box(lengths: tuple[int, ...], itemsize: int, cap: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-boxes ``(offsets, lengths)`` of a box of ``lengths``, in row-major order, each of at most
    ``cap`` bytes and each a contiguous byte range of the box's packed row-major bytes.

    Splits the first dimension ``d`` whose trailing block (``lengths[d+1:]``) fits in ``cap``:
    indices of dimensions before ``d`` are fixed per sub-box, ``d`` is cut into ranges of as many
    rows as fit, later dimensions stay whole."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or math.prod(lengths) * itemsize <= cap or 0 in lengths:
        return [((0,) * len(lengths), lengths)]
    d = next(d for d in range(len(lengths)) if math.prod(lengths[d + 1:]) * itemsize <= cap)
    rows = max(1, cap // (math.prod(lengths[d + 1:]) * itemsize))
    out = []
    for lead in itertools.product(*(range(n) for n in lengths[:d])):
        for start in range(0, lengths[d], rows):
            n = min(rows, lengths[d] - start)
            out.append((lead + (start,) + (0,) * (len(lengths) - d - 1), (1,) * d + (n,) + lengths[d + 1:]))
    return out


def split_reads(items: Iterable[ReadItem], itemsize: Callable[[ReadItem], int], staged: Callable[[ReadItem], bool],
                cap: int | None = None) -> list[ReadItem]:
    """Read items with every tensor item of a staged target cut into sub-boxes of at most ``cap``
    (default :data:`STAGE_BYTES`) bytes (storage and destination offsets shifted alike), so a
    staging buffer holds any item."""
    cap = STAGE_BYTES if cap is None else cap
    out: list[ReadItem] = []
    for item in items:
        if item.type == LoadItemType.BYTE_IO or not staged(item):
            out.append(item)
            continue
        parts = split_box(tuple(item.lengths), itemsize(item), cap)
        if len(parts) == 1:
            out.append(item)
            continue
        for offs, lens in parts:
            out.append(replace(
                item,
                dest_offsets=torch.Size(a + b for a, b in zip(item.dest_offsets, offs)),
                storage_offsets=torch.Size(a + b for a, b in zip(item.storage_offsets, offs)),
                lengths=torch.Size(lens),
            ))
    return out


@dataclass
class PoolStats:
    """What a staging pool did during one read."""

    allocated: int = 0
    """Buffers allocated (pinned when the targets are CUDA tensors)."""
    peak_in_use: int = 0
    """Most buffers held at once (being filled or with a copy in flight)."""
    acquires: int = 0
    """Buffers handed out."""
    waits: int = 0
    """Times a reader waited for an in-flight copy to free a buffer (the pool was full)."""
    staged_bytes: int = 0
    """Bytes copied to targets through the pool."""


class StagingPool:
    """At most ``count`` host buffers of ``buffer_bytes``; a released buffer with a pending device
    copy is reused only after its event completes (the oldest is waited for when all are busy)."""

    def __init__(self, buffer_bytes: int, count: int = BUFFERS_PER_THREAD, pin: bool = False) -> None:
        self.buffer_bytes, self.count, self.pin = buffer_bytes, max(1, count), pin
        self.stats = PoolStats()
        self._free: list[torch.Tensor] = []
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self) -> torch.Tensor:
        """A ``uint8`` buffer of ``buffer_bytes`` (blocks while all are held by readers)."""
        with self._cond:
            while True:
                self._reclaim(block=False)
                if self._free:
                    buf = self._free.pop()
                    break
                if self.stats.allocated < self.count:
                    buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)
                    self.stats.allocated += 1
                    break
                if self._pending:
                    self.stats.waits += 1
                    self._reclaim(block=True)
                    continue
                self._cond.wait()  # every buffer is being filled by another thread
            self._in_use += 1
            self.stats.acquires += 1
            self.stats.peak_in_use = max(self.stats.peak_in_use, self._in_use)
            return buf

    def release(self, buf: torch.Tensor, event: Any = None) -> None:
        """Give ``buf`` back; ``event`` (if any) marks the end of the copy that reads from it."""
        with self._cond:
            self._in_use -= 1
            if event is None:
                self._free.append(buf)
            else:
                self._pending.append((buf, event))
            self._cond.notify()

    def drain(self) -> None:
        """Wait for every copy in flight (once per read, not per item)."""
        with self._cond:
            while self._pending:
                self._reclaim(block=True)

    def _reclaim(self, block: bool) -> None:
        while self._pending:
            buf, event = self._pending[0]
            if block:
                event.synchronize()
                block = False  # one wait, then take whatever else has completed
            elif not event.query():
                return
            self._pending.popleft()
            self._free.append(buf)


def to_device(pool: StagingPool, buf: torch.Tensor, dtype: torch.dtype, lengths: tuple[int, ...],
              target: torch.Tensor) -> None:
    """Copy the packed bytes at the start of ``buf`` (a box of ``lengths`` in ``dtype``) into
    ``target`` and give ``buf`` back to ``pool`` once the copy has read it.

    Device targets get a non-blocking copy on their device's current stream (a conversion to
    another dtype runs on the device after the copy); CPU targets (forced staging) a plain copy."""
    nbytes = math.prod(lengths) * dtype.itemsize
    src = buf[:nbytes].view(dtype).view(lengths)
    if target.device.type != "cuda":
        target.copy_(src)
        pool.stats.staged_bytes += nbytes
        pool.release(buf)
        return
    stream = torch.cuda.current_stream(target.device)
    with torch.cuda.stream(stream):
        if target.dtype == dtype:
            target.copy_(src, non_blocking=True)
        else:  # copy as saved, convert on the device (a host-side conversion would block)
            tmp = torch.empty(lengths, dtype=dtype, device=target.device)
            tmp.copy_(src, non_blocking=True)
            target.copy_(tmp)
        event = torch.cuda.Event()
        event.record(stream)
    pool.stats.staged_bytes += nbytes
    pool.release(buf, event)


class HostCopies:
    """Host copies of the tensors a writer will write, ``depth`` items ahead: device tensors are
    copied into pinned memory with non-blocking copies, so the copy of the next items overlaps the
    write of this one. CPU tensors pass through (copied only when ``forced``, for tests).

    Iterating yields ``(item, host_tensor)`` in order; at most ``depth + 1`` copies are alive."""

    def __init__(self, items: list[Any], resolve: Callable[[Any], torch.Tensor], depth: int = 2,
                 forced: bool = False) -> None:
        self.items, self.resolve, self.depth, self.forced = items, resolve, max(1, depth), forced
        self.copied_bytes = 0
        """Bytes copied device-to-host (or host-to-host when forced)."""

    def _start(self, item: Any) -> tuple[Any, torch.Tensor, Any]:
        t = self.resolve(item).detach()
        if t.device.type == "cpu" and not self.forced:
            return item, t, None
        self.copied_bytes += t.nbytes
        if t.device.type != "cuda":
            return item, t.to("cpu", copy=True), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream = torch.cuda.current_stream(t.device)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return item, host, event

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        ahead: deque[tuple[Any, torch.Tensor, Any]] = deque()
        todo = iter(self.items)
        for item in itertools.islice(todo, self.depth):
            ahead.append(self._start(item))
        while ahead:
            item, host, event = ahead.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                ahead.append(self._start(nxt))
            if event is not None:
                event.synchronize()
            yield item, host

