"""Host staging between files and device memory: bounded pinned buffers, stream-ordered copies.

A load into device tensors cannot read file bytes straight into the target (``preadv`` and
``mmap`` need host memory), and a save cannot ``torch.save`` a device tensor without a host copy.
Both go through host memory here, with bounds and overlap:

- **Loads**: every read item for a device target is at most ``STAGE_BYTES`` (larger boxes are split
  into sub-boxes whose bytes are contiguous runs of the box, :func:`ucp_dcp.planning.device.split_box`). Its bytes land in a
  buffer of a :class:`StagingPool` (a few pinned buffers per reading thread) and go to the device
  with a non-blocking copy on the target device's current stream; the buffer returns to the pool
  with an event, and is reused only once that event completes. Reading the next item overlaps the
  copy, and nothing synchronizes per item: one wait at the end of the read.
- **Saves**: :class:`HostCopies` issues the device-to-host copies of the next items into pinned
  memory while the writer writes the current one.

``UCP_DCP_STAGING=always`` (or ``UCPFileSystemReader(staging="always")``) sends CPU targets through
the same path, so a machine without a GPU exercises every branch a device load takes
(:mod:`ucp_dcp.planning.device` decides which targets are staged and cuts their read items).

Why not DCP's: its reader copies each read item into its target with one blocking ``copy_``
(``FileSystemReader.read_data``): there is no load-side staging to reuse. Its save side,
``filesystem._OverlappingCpuLoader``, is private to ``FileSystemWriter``'s write loop and waits on the
whole stream at its byte bound; :class:`HostCopies` waits on each item's own event.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BUFFERS_PER_THREAD", "StagingPool", "PoolStats", "HostCopies", "to_device"]

BUFFERS_PER_THREAD = 3
"""Staging buffers per reading thread: one being filled, two whose copies may still be in flight."""


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


def to_device(
    pool: StagingPool, buf: torch.Tensor, dtype: torch.dtype, lengths: tuple[int, ...], target: torch.Tensor
) -> None:
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

    def __init__(
        self, items: list[Any], resolve: Callable[[Any], torch.Tensor], depth: int = 2, forced: bool = False
    ) -> None:
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
