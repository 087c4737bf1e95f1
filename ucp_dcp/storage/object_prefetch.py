"""Small reads of one object on a store fetched together: a rank's read task of an object reads its chunks in
offset order, one ranged GET each; a model's many small items (norms, biases, scalars, objects) would cost a
request each, where DCP's ``FsspecReader`` collapses them through fsspec's 5 MiB read-ahead (reading every
byte of the file it passes). Here the bytes those items need -- an object's whole record, a small tensor's
data when the rank needs all of it -- are known before reading (the I/O table gives each tensor's data
offset), so they are fetched as a few ranges joined across the records' framing between them
(:data:`FRAME_GAP`) and across larger gaps within :data:`~ucp_dcp.storage.file_ranges.REMOTE_WASTE`, all in
flight at once, and the reads are then served from
those buffers (:meth:`~ucp_dcp.storage.object_streams.RangedObjectFile.prefetch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .file_ranges import coalesce_within

__all__ = ["FRAME_GAP", "PREFETCH_ITEM_BYTES", "PREFETCH_BATCH_BYTES", "prefetch_batches"]

PREFETCH_ITEM_BYTES = 8 << 20
"""Items up to this size are prefetched (larger ones are a request's worth of bytes on their own): a column
slice's band chunks (``storage/tiles.py``), consecutive records of 1-8 MiB, become one GET per object."""
PREFETCH_BATCH_BYTES = 32 << 20
"""Most bytes fetched ahead at once (host memory held until the task's reads pass them)."""
FRAME_GAP = 8 << 10
"""Gaps up to this size between prefetched spans are fetched too, whatever the waste budget: they are the
records' own framing (a ``torch.save`` zip record's headers and directory, about 1 KiB), not another
item's data; without them a model's small tensors, each a few KiB, would each stay a request."""


def prefetch_batches(
    chunks: Sequence[Any], span: Callable[[Any], tuple[int, int] | None]
) -> tuple[list[list[tuple[int, int]]], dict[int, int]]:
    """``(batches, batch of chunk)``: the ``(start, length)`` spans ``span(chunk)`` gives (None: not
    prefetched) in file order, cut into batches of at most :data:`PREFETCH_BATCH_BYTES`, each batch's spans
    joined within the waste budget; the map is ``id(chunk)`` -> batch index. No batch for a lone span."""
    spans = [(s, c) for c in chunks if (s := span(c)) is not None and 0 < s[1] <= PREFETCH_ITEM_BYTES]
    spans.sort(key=lambda x: x[0][0])
    groups: list[list[tuple[tuple[int, int], Any]]] = []
    size = math.inf
    for s, c in spans:
        if size + s[1] > PREFETCH_BATCH_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((s, c))
        size += s[1]
    batches: list[list[tuple[int, int]]] = []
    of: dict[int, int] = {}
    for g in groups:
        if len(g) < 2:
            continue  # one span is one request either way
        merged: list[tuple[int, int]] = []
        for (a, n), _ in g:  # union (spans of one object may touch), then joined within the budget
            if merged and a <= merged[-1][0] + merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][0] + merged[-1][1], a + n) - merged[-1][0])
            else:
                merged.append((a, n))
        framed: list[tuple[int, int]] = []
        for a, n in merged:
            if framed and a - (framed[-1][0] + framed[-1][1]) <= FRAME_GAP:
                framed[-1] = (framed[-1][0], a + n - framed[-1][0])
            else:
                framed.append((a, n))
        batches.append(coalesce_within(framed))
        for _, c in g:
            of[id(c)] = len(batches) - 1
    return batches, of
