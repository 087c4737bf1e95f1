"""Column bands: how the writer lays 2-D+ chunks out on object stores so a column slice is a few ranges.

A chunk saved row-major puts a column slice (a tensor saved sharded on dim 0, loaded sharded on dim 1:
a tensor-parallel dim change) in one run per saved row. A local file serves those runs from a mapping;
an object store serves one range per request, so a slice of narrow rows costs either a request per row
(8,160 GETs for 8 MiB) or whole rows (4x the bytes at a degree of 4). Stores give no multi-range GET
(S3 answers one range per request).

So, on object stores, the writer cuts such a chunk along dim 1 into ``bands`` equal **band chunks**,
each an ordinary DCP chunk (its own ``torch.save`` record, written one after the other in the same
object, its own block and tile sums). The checkpoint stays DCP's format — the metadata simply lists
more, narrower chunks, which every DCP reader and planner reshards from — and:

* a column slice whose edges fall on band edges (every degree dividing ``bands``) is whole band
  chunks, consecutive in the object: one range, the slice's bytes plus a record frame per band;
* a row slice (a data-parallel change) is one range per band instead of one per chunk, which is why a
  band chunk holds at least :data:`BAND_BYTES` (the bytes the reader prices a request at) and there
  are at most :data:`MAX_BANDS`.

Pure functions; :class:`~ucp_dcp.storage.writer.UCPFileSystemWriter` applies them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

__all__ = ["BAND_BYTES", "MAX_BANDS", "ColumnBands", "column_bands", "band_boxes", "band_chunks"]

ColumnBands = Literal["store", "always", "off"]
"""Where the writer cuts chunks into column bands: on object stores only (default), everywhere, nowhere."""

BAND_BYTES = 1 << 20
"""Fewest bytes per band chunk: a row slice costs a request per band, so a band is worth a request."""
MAX_BANDS = 8
"""Most bands per chunk: tensor-parallel degrees 2, 4 and 8 (dividing dim 1) read whole bands."""
MIN_RUN = 512
"""Fewest bytes of one row inside a band (narrower runs gain nothing over whole rows)."""


def column_bands(sizes: Sequence[int], itemsize: int) -> int:
    """How many band chunks a chunk of ``sizes`` is written as (1: as it is). The largest of
    :data:`MAX_BANDS`, ..., 2 dividing dim 1 that leaves every band chunk :data:`BAND_BYTES` or more
    and every row's band :data:`MIN_RUN` bytes or more."""
    if len(sizes) < 2:
        return 1
    cols, inner = int(sizes[1]), math.prod(sizes[2:]) * itemsize
    nbytes = int(sizes[0]) * cols * inner
    b = MAX_BANDS
    while b >= 2:
        if cols % b == 0 and nbytes // b >= BAND_BYTES and cols // b * inner >= MIN_RUN:
            return b
        b //= 2
    return 1


def band_boxes(offsets: Sequence[int], sizes: Sequence[int], bands: int) -> list[tuple[torch.Size, torch.Size]]:
    """``(offsets, sizes)`` of the ``bands`` band chunks of the chunk at ``offsets`` of ``sizes``, in dim-1 order."""
    width = int(sizes[1]) // bands
    out = []
    for k in range(bands):
        offs = list(offsets)
        offs[1] = int(offsets[1]) + k * width
        out.append((torch.Size(offs), torch.Size([sizes[0], width, *sizes[2:]])))
    return out


def band_chunks(metadata: Metadata, banded: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int]]) -> None:
    """Replace in ``metadata`` every chunk of ``banded`` — ``(fqn, offsets)``: ``(sizes, bands)`` — by its
    band chunks. A chunk already replaced (metadata a cached plan reuses: its first band has the chunk's
    offsets but not its sizes) is left as it is."""
    by_fqn: dict[str, dict[tuple[int, ...], tuple[tuple[int, ...], int]]] = {}
    for (fqn, offsets), cut in banded.items():
        by_fqn.setdefault(fqn, {})[tuple(offsets)] = cut
    for fqn, cuts in by_fqn.items():
        smd = metadata.state_dict_metadata.get(fqn)
        if not isinstance(smd, TensorStorageMetadata):
            continue
        chunks: list[ChunkStorageMetadata] = []
        for c in smd.chunks:
            sizes, bands = cuts.get(tuple(c.offsets), ((), 1))
            if bands > 1 and tuple(c.sizes) == tuple(sizes):
                chunks.extend(ChunkStorageMetadata(o, s) for o, s in band_boxes(c.offsets, c.sizes, bands))
            else:
                chunks.append(c)
        smd.chunks = chunks
