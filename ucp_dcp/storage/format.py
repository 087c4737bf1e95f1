"""Where a saved chunk's bytes are, and which byte ranges a box of it needs.

DCP stores every item as a ``torch.save`` zip inside a ``.distcp`` file. ``torch.save`` writes tensor
storage uncompressed and aligned, and the zip directory records where (``get_record_offset``), so a
box of a row-major chunk is a set of equal-length byte runs that can be read without deserializing
the chunk. Pure helpers plus a tiny zip/pickle parser for items written without ucp_dcp's writer.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._compat import dtype_of_storage_type, torch_file_reader
from ..errors import CorruptCheckpointError, TruncatedFileError
from ..planning.ties import IO_KEY, item_key  # defined with the planner, which compares saved digests

__all__ = [
    "IO_KEY",
    "IO_VERSION",
    "BLOCK",
    "RECORD_ALIGN",
    "TensorRecord",
    "parse_tensor_record",
    "BoxGrid",
    "box_grid",
    "box_runs",
    "gather_grid",
    "split_grid",
    "merge_intervals",
    "HASHES",
    "DEFAULT_HASH",
    "block_hash",
    "block_checksums",
    "blocks_touching",
    "item_key",
    "read_key",
    "check_tables",
    "chunk_meta",
]

BLOCK = 1 << 20
"""Checksum block: 1 MiB of tensor bytes."""
RECORD_ALIGN = 64
"""File offset every tensor record starts at a multiple of. ``torch.save`` puts a record's data at a
64-byte multiple from the record's start, so the data lands 64-byte aligned in the file too: a read of
records packed back to back (DCP's layout) copies from odd source addresses, about 2x slower out of the
page cache (``docs/performance.md``). The gap (zeros) belongs to no item and is never read."""
IO_VERSION = 3
"""Version of the I/O table. 1: tensor entries ``[data_offset, block sums]``. 2: tensor entries
``[data_offset, block sums, frame sum]`` (the frame: the item's bytes outside the tensor data),
object entries ``[0, block sums of the whole item, None]``, and an integrity sidecar next to
``.metadata`` (:mod:`ucp_dcp.storage.sidecar`). 3: tensor entries gain a fourth element, the tile sums
``[bands, rows_per_tile, sums]`` of a chunk of two or more dims, else None (:mod:`ucp_dcp.storage.tiles`);
readers of version 2 ignore it."""


@dataclass(frozen=True)
class TensorRecord:
    """Where a saved chunk's elements are inside its item."""

    data_offset: int
    """Offset of element 0 relative to the item's first byte."""
    dtype: torch.dtype
    """Element type as saved."""
    shape: tuple[int, ...]
    """Shape of the saved tensor."""
    contiguous: bool
    """Row-major without gaps (only then can boxes be read as byte runs)."""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class _MetaUnpickler(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` without touching storages: returns the rebuild arguments."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_args
        if module == "torch" and name.endswith("Storage"):
            return dtype_of_storage_type(name)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name in (
            "float32",
            "float16",
            "bfloat16",
            "float64",
            "int64",
            "int32",
            "uint8",
            "int8",
            "int16",
            "bool",
            "complex64",
            "complex128",
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a tensor record")

    def persistent_load(self, pid):
        return pid


def _tensor_args(
    storage: Any,
    offset: int,
    size: Any,
    stride: Any,
    requires_grad: bool = False,
    hooks: Any = None,
    metadata: Any = None,
    *rest: Any,
) -> tuple[Any, ...]:
    """``_rebuild_tensor_v2``'s arguments; a tensor whose metadata sets bits (a conjugate or negative
    view: the stored bytes are not the values) is not a plain record."""
    if metadata or rest:
        return ("view",)
    return ("tensor", storage, offset, tuple(size), tuple(stride))


def parse_tensor_record(item: io.IOBase) -> TensorRecord | None:
    """Layout of the tensor inside one ``torch.save`` item (a seekable view of it), or None when
    it is not a plain tensor record we can read by ranges."""
    try:
        reader = torch_file_reader(item)
        meta = _MetaUnpickler(io.BytesIO(reader.get_record("data.pkl"))).load()
    except Exception:
        return None
    if not (isinstance(meta, tuple) and len(meta) == 5 and meta[0] == "tensor"):
        return None
    _, storage, offset, size, stride = meta
    _, dtype, key, _, _ = storage
    if not isinstance(dtype, torch.dtype):
        return None
    itemsize = dtype.itemsize
    expect = tuple(int(math.prod(size[d + 1 :])) for d in range(len(size)))
    contiguous = all(s == e for s, e, n in zip(stride, expect, size) if n > 1)
    data_offset = reader.get_record_offset(f"data/{key}") + int(offset) * itemsize
    return TensorRecord(data_offset, dtype, tuple(int(s) for s in size), contiguous)


@dataclass(frozen=True)
class BoxGrid:
    """A box of a row-major chunk as a grid of equal byte runs: run ``i`` (a multi-index over
    ``counts``) starts at ``first + sum(i[d] * strides[d])``; runs in row-major order of ``i`` are
    the box's elements in row-major order."""

    first: int
    """Byte offset (within the chunk's data) of the first run."""
    counts: tuple[int, ...]
    """Runs along each outer dimension (empty: the box is one run)."""
    strides: tuple[int, ...]
    """Byte distance between consecutive runs along each outer dimension (all positive)."""
    run: int
    """Bytes per run (0 for an empty box)."""

    @property
    def nruns(self) -> int:
        return math.prod(self.counts) if self.run else 0

    @property
    def nbytes(self) -> int:
        return self.nruns * self.run

    @property
    def end(self) -> int:
        """One past the last byte of the last run."""
        return (
            self.first + sum((c - 1) * s for c, s in zip(self.counts, self.strides)) + self.run
            if self.run
            else self.first
        )

    def starts(self) -> np.ndarray:
        """Start offset of every run, in row-major grid order."""
        if not self.run:
            return np.zeros(0, dtype=np.int64)
        out = np.full(1, self.first, dtype=np.int64)
        for c, s in zip(self.counts, self.strides):
            out = (out[:, None] + np.arange(c, dtype=np.int64)[None, :] * s).reshape(-1)
        return out


def box_grid(shape: Sequence[int], itemsize: int, offsets: Sequence[int], sizes: Sequence[int]) -> BoxGrid:
    """The byte runs of box ``offsets``/``sizes`` of a row-major chunk of ``shape``."""
    ndim = len(shape)
    if ndim == 0:
        return BoxGrid(0, (), (), itemsize)
    if any(n == 0 for n in sizes):
        return BoxGrid(0, (), (), 0)
    # innermost dims covered in full collapse into one run; outer dims of size 1 add no runs
    k = ndim - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(ndim)]
    first = sum(offsets[d] * strides[d] for d in range(k + 1))
    outer = [d for d in range(k) if sizes[d] > 1]
    return BoxGrid(first, tuple(sizes[d] for d in outer), tuple(strides[d] for d in outer), sizes[k] * strides[k])


def box_runs(
    shape: Sequence[int], itemsize: int, offsets: Sequence[int], sizes: Sequence[int]
) -> tuple[np.ndarray, int]:
    """Byte runs of a box of a row-major chunk: ``(starts, run_length)``, starts in row-major box
    order (so the runs, concatenated, are the box's elements in row-major order)."""
    g = box_grid(shape, itemsize, offsets, sizes)
    return g.starts(), g.run


def gather_grid(src: np.ndarray, src_start: int, grid: BoxGrid, out: np.ndarray) -> None:
    """Copy the runs of ``grid`` from ``src`` (uint8, holding chunk bytes from ``src_start``) into
    ``out`` (uint8, ``grid.nbytes``), in order: one strided copy, no per-run Python work."""
    if not grid.run:
        return
    lo, hi = grid.first - src_start, grid.end - src_start
    if lo < 0 or hi > len(src) or len(out) != grid.nbytes:  # as_strided does no bounds checks
        raise TruncatedFileError(  # bytes read fewer than the record says: a short file
            f"grid [{grid.first}, {grid.end}) outside source [{src_start}, {src_start + len(src)})"
        )
    view = np.lib.stride_tricks.as_strided(
        src[lo:], shape=(*grid.counts, grid.run), strides=(*grid.strides, 1), writeable=False
    )
    np.copyto(out.reshape(*grid.counts, grid.run), view)


def split_grid(grid: BoxGrid, limit: int) -> list[BoxGrid]:
    """``grid`` cut into consecutive pieces (in run order) each spanning at most ``limit`` bytes of
    the chunk where possible, so a strided read maps a bounded window at a time."""
    if grid.end - grid.first <= limit or not grid.run:
        return [grid]
    if not grid.counts:  # one long run: cut it
        return [BoxGrid(grid.first + j, (), (), min(limit, grid.run - j)) for j in range(0, grid.run, limit)]
    c0, s0 = grid.counts[0], grid.strides[0]
    step = max(1, limit // s0)
    out: list[BoxGrid] = []
    for i in range(0, c0, step):
        n = min(step, c0 - i)
        if n > 1:
            out.append(BoxGrid(grid.first + i * s0, (n, *grid.counts[1:]), grid.strides, grid.run))
        else:
            out.extend(split_grid(BoxGrid(grid.first + i * s0, grid.counts[1:], grid.strides[1:], grid.run), limit))
    return out


def merge_intervals(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Union of ``[start, start + length)`` intervals, merged when they touch or overlap."""
    if len(starts) == 0:
        return []
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], starts[order] + lengths[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]  # an interval opens a new group unless it starts within reach
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return [(int(a), int(b - a)) for a, b in zip(s[first], reach[last])]


HASHES: dict[str, Callable[[], Any]] = {"xxh3_64": xxhash.xxh3_64}
"""Block checksum algorithms by the name recorded in the I/O table: streaming objects with
``update(bytes)`` and ``intdigest()``."""
DEFAULT_HASH = "xxh3_64"
"""Written by default: XXH3-64 runs at ~25 GB/s per core here against ~6 GB/s for zlib's CRC32, which
is what makes verify-on-read cheap enough to be the default (see docs/performance.md). A checkpoint
records its algorithm; one this version does not know is read unverified, with a warning."""


def block_hash(data: Any, algo: str = DEFAULT_HASH) -> int:
    """Checksum of one block."""
    h = HASHES[algo]()
    h.update(data)
    return int(h.intdigest())


def block_checksums(data: memoryview, block: int = BLOCK, algo: str = DEFAULT_HASH) -> list[int]:
    """Checksum of every ``block``-byte block of ``data`` (the last one may be shorter)."""
    return [block_hash(data[i : i + block], algo) for i in range(0, len(data), block)] or [block_hash(b"", algo)]


def blocks_touching(intervals: Sequence[tuple[int, int]], nbytes: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """Intervals widened to whole checksum blocks (so the blocks they touch can be verified), merged."""
    widened = []
    for s, n in intervals:
        a = (s // block) * block
        b = min(nbytes, -(-(s + n) // block) * block)
        widened.append((a, b - a))
    if not widened:
        return []
    arr = np.array(widened, dtype=np.int64)
    return merge_intervals(arr[:, 0], arr[:, 1])


def read_key(item: ReadItem) -> str:
    """Identity of the saved bytes a read item needs (equal across ranks needing the same bytes)."""
    if item.type == LoadItemType.BYTE_IO:
        return f"{item.storage_index.fqn}|b"
    s = item.storage_index
    return f"{s.fqn}|{list(s.offset or ())}|{list(item.storage_offsets)}|{list(item.lengths)}"


def check_tables(md: Metadata) -> None:
    """Every saved chunk and object must have a storage entry (else a read would be a bare
    ``KeyError``): a metadata file whose tables disagree is corrupt."""
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CorruptCheckpointError(
                    f"checkpoint metadata lists object '{fqn}' but has no storage entry for it",
                    atom=fqn,
                    hint="the checkpoint's metadata is damaged; restore it",
                )
            continue
        for ch in smd.chunks:
            if MetadataIndex(fqn, ch.offsets) not in storage:
                raise CorruptCheckpointError(
                    f"checkpoint metadata lists chunk {list(ch.offsets)} of atom '{fqn}' but has no storage entry "
                    "for it",
                    atom=fqn,
                    saved=list(ch.offsets),
                    hint="the checkpoint's metadata is damaged; restore it from a good copy",
                )


def chunk_meta(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]]:
    """Saved dtype and shape of every chunk, by storage index."""
    out = {}
    for fqn, smd in metadata.state_dict_metadata.items():
        chunks = getattr(smd, "chunks", None)
        if chunks is None:
            continue
        for ch in chunks:
            out[MetadataIndex(fqn, ch.offsets)] = (smd.properties.dtype, tuple(int(x) for x in ch.sizes))
    return out
