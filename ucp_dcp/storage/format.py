"""Where a saved chunk's bytes are, and which byte ranges a box of it needs.

DCP stores every item as a ``torch.save`` zip inside a ``.distcp`` file. ``torch.save`` writes tensor
storage uncompressed and aligned, and the zip directory records where (``get_record_offset``), so a
box of a row-major chunk is a set of equal-length byte runs that can be read without deserializing
the chunk. Pure helpers plus a tiny zip/pickle parser for items written without ucp_dcp's writer, and
the block checksums that cover a chunk's bytes: computed at save, verified at load (:class:`BlockChecker`).
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
from ..errors import ChecksumError, CorruptCheckpointError, TruncatedFileError
from ..planning.ties import IO_KEY, item_key  # defined with the planner, which compares saved digests

__all__ = [
    "BlockChecker",
    "IO_KEY",
    "IO_VERSION",
    "BLOCK",
    "MIN_BLOCK",
    "BLOCKS_PER_RECORD",
    "checksum_block",
    "BlockSums",
    "NO_SUMS",
    "entry_sums",
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
    "TABLE_HASH",
    "digest_name",
    "block_hash",
    "block_checksums",
    "blocks_touching",
    "item_key",
    "read_key",
    "check_tables",
    "chunk_meta",
]

BLOCK = 1 << 20
"""Largest checksum block: 1 MiB. The block of every record of an I/O table up to version 3, of objects, and of
tensor records of at least ``BLOCKS_PER_RECORD`` MiB."""
MIN_BLOCK = 1 << 10
"""Smallest checksum block of a tensor record: 1 KiB. Caps the sums at one per KiB of data (a JSON sum is ~20
bytes: at most 2% of the data's size in the sidecar), and keeps hashing at ~2 GB/s a core (per-block call cost)."""
BLOCKS_PER_RECORD = 64
"""Fewest blocks a tensor record is cut into (above ``64 * MIN_BLOCK`` bytes, below ``64 * BLOCK``): a load that
cuts a saved chunk at ``k`` places reads at most ``k`` blocks it does not need, at most ``k/64`` of the chunk."""
RECORD_ALIGN = 64
"""File offset every tensor record starts at a multiple of. ``torch.save`` puts a record's data at a
64-byte multiple from the record's start, so the data lands 64-byte aligned in the file too: a read of
records packed back to back (DCP's layout) copies from odd source addresses, about 2x slower out of the
page cache (``docs/performance.md``). The gap (zeros) belongs to no item and is never read."""
IO_VERSION = 4
"""Version of the I/O table. 1: tensor entries ``[data_offset, block sums]``. 2: tensor entries
``[data_offset, block sums, frame sum]`` (the frame: the item's bytes outside the tensor data),
object entries ``[0, block sums of the whole item, None]``, and an integrity sidecar next to
``.metadata`` (:mod:`ucp_dcp.storage.sidecar`). 3: tensor entries gain a fourth element, the tile sums
``[bands, rows_per_tile, sums]`` of a chunk of two or more dims, else None (:mod:`ucp_dcp.storage.tiles`);
readers of version 2 ignore it. 4: tensor entries gain a fifth element, the block their block sums cover
(:func:`checksum_block` of the record's size); entries without it (objects, tables up to version 3) use the
table's ``"block"``; its ``"algo"`` is :data:`TABLE_HASH`, which readers before version 4 do not know."""


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
    except Exception:  # not a zip record we can cut by ranges: the caller decodes the item whole (its safe path)
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


DEFAULT_HASH = "xxh3_64"
"""The block checksum computed by default: XXH3-64 runs at ~25 GB/s per core here against ~6 GB/s for zlib's
CRC32, which is what makes verify-on-read cheap enough to be the default (see docs/performance.md). A
checkpoint records its algorithm; one this version does not know is read unverified, with a warning."""
TABLE_HASH = "xxh3_64-record-blocks"
"""The name a table written now records for :data:`DEFAULT_HASH`: the same digests, over blocks sized per
record (each tensor entry's fifth element, version 4). A name of its own because a ucp_dcp from before
version 4 reads every entry's sums as the table's one 1 MiB block and would fail every tensor over 1 KiB
with a false ``ChecksumError``; a name it does not know makes it read unverified with a warning that says
so. Tables that recorded ``xxh3_64`` (up to version 3, and version 4 before this name) read as before."""
HASHES: dict[str, Callable[[], Any]] = {DEFAULT_HASH: xxhash.xxh3_64, TABLE_HASH: xxhash.xxh3_64}
"""Block checksum algorithms by the name recorded in the I/O table: streaming objects with
``update(bytes)`` and ``intdigest()``."""


def digest_name(algo: str | None) -> str | None:
    """The digest a table's algorithm name stands for, as messages name it (``xxh3_64``)."""
    return DEFAULT_HASH if algo == TABLE_HASH else algo


def block_hash(data: Any, algo: str = DEFAULT_HASH) -> int:
    """Checksum of one block."""
    h = HASHES[algo]()
    h.update(data)
    return int(h.intdigest())


_ONE_SHOT: dict[str, Callable[[Any], int]] = {
    DEFAULT_HASH: xxhash.xxh3_64_intdigest,
    TABLE_HASH: xxhash.xxh3_64_intdigest,
}
"""One-call forms of :data:`HASHES` (same digests): a 1 KiB block costs one C call, not three (2.1 against
0.8 GB/s on this VM's cores), which is what makes :data:`MIN_BLOCK` affordable."""


def block_checksums(data: memoryview, block: int = BLOCK, algo: str = DEFAULT_HASH) -> list[int]:
    """Checksum of every ``block``-byte block of ``data`` (the last one may be shorter)."""
    one = _ONE_SHOT.get(algo) or (lambda b: block_hash(b, algo))
    return [one(data[i : i + block]) for i in range(0, len(data), block)] or [block_hash(b"", algo)]


def checksum_block(nbytes: int) -> int:
    """The checksum block the writer uses for a tensor record of ``nbytes`` bytes: the largest power of two
    ``B`` with ``BLOCKS_PER_RECORD * B <= nbytes``, clamped to ``[MIN_BLOCK, BLOCK]``.

    Why: a verified read of part of a record reads the whole blocks it touches, so a load that cuts a record
    at ``k`` places reads at most ``k * B`` bytes more than it needs (the block around each cut, shared by the
    ranks on its two sides). ``B <= nbytes / 64`` bounds that at ``k / 64`` of the record (1.047x for the
    three cuts of a 1 -> 4 load) down to 64 KiB records; records of 64 MiB and more keep 1 MiB blocks.
    A power of two: cuts at row boundaries of power-of-two shapes fall on block edges and cost nothing."""
    per = nbytes // BLOCKS_PER_RECORD
    if per < MIN_BLOCK:
        return MIN_BLOCK
    return min(BLOCK, 1 << (per.bit_length() - 1))  # the largest power of two <= per


@dataclass(frozen=True)
class BlockSums:
    """A record's block checksums and the block they cover: ``sums[b]`` is the checksum of bytes
    ``[b * block, (b + 1) * block)`` of the record's data (an object's: of its whole item). False when
    there are none (no checksums, or verification off)."""

    block: int
    """Block size in bytes."""
    sums: Sequence[int]
    """One checksum per block, in order (the last block may be shorter)."""

    def __bool__(self) -> bool:
        return bool(self.sums)

    def span(self, b: int, nbytes: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of block ``b`` of a record of ``nbytes`` bytes."""
        return b * self.block, min((b + 1) * self.block, nbytes)


NO_SUMS = BlockSums(BLOCK, ())
"""Nothing to verify."""


def entry_sums(entry: Sequence[Any] | None, table_block: int, index: MetadataIndex | None = None) -> BlockSums:
    """The block sums of an I/O-table entry with their block: a version-4 tensor entry's own (its fifth
    element), else ``table_block`` (the table's ``"block"``: every entry of a table up to version 3, and
    objects). The table is untrusted input: a block that is not a positive int is a corrupt checkpoint."""
    if not entry or len(entry) < 2 or not entry[1]:
        return NO_SUMS
    block = entry[4] if len(entry) > 4 and entry[4] is not None else table_block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        fqn = index.fqn if index is not None else None
        raise CorruptCheckpointError(
            f"the I/O table records checksum block {block!r} for '{fqn}' chunk "
            f"{list(index.offset or ()) if index is not None else '?'}: not a positive byte count",
            atom=fqn,
            saved=block,
            hint="the checkpoint's I/O table is damaged; restore the checkpoint from a good copy",
        )
    return BlockSums(block, entry[1])


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


# verifying bytes against a record's sums, one block at a time (each record's own block)


@dataclass(frozen=True)
class BlockChecker:
    """Checks bytes of a saved chunk against its block checksums (a :class:`BlockSums`
    from the I/O table: each record carries the block its sums cover)."""

    algo: str
    """Hash name (a key of :data:`HASHES`)."""

    def verify(self, buf: memoryview, start: int, crcs: BlockSums, rel: str, index: MetadataIndex) -> None:
        """Verify block-aligned bytes ``buf`` starting at chunk offset ``start``."""
        B = crcs.block
        got = block_checksums(buf, B, self.algo) if len(buf) else []
        for k, h in enumerate(got):
            self.check(start // B + k, h, crcs, rel, index)

    def verify_span(
        self,
        pread: Callable[[int, int], memoryview],
        base: int,
        start: int,
        data: memoryview,
        crcs: BlockSums,
        nbytes: int,
        rel: str,
        index: MetadataIndex,
    ) -> None:
        """Verify the blocks touched by ``data`` (chunk bytes ``[start, start + len(data))``), reading
        only the parts of the first and last block that lie outside it (``pread(offset, n)``)."""
        B = crcs.block
        end = start + len(data)
        b0, b1 = start // B, (max(end, start + 1) - 1) // B

        def edge(b: int) -> None:  # a block that may stick out of ``data``: its outside bytes are read
            bs, be = crcs.span(b, nbytes)
            a, c = max(bs, start), min(be, end)
            h = HASHES[self.algo]()
            if bs < a:
                h.update(pread(base + bs, a - bs))
            h.update(data[a - start : c - start])
            if c < be:
                h.update(pread(base + c, be - c))
            self.check(b, int(h.intdigest()), crcs, rel, index)

        edge(b0)
        if b1 - b0 > 1:  # the blocks strictly inside ``data``: hashed straight from it, one call per block
            inner = data[(b0 + 1) * B - start : b1 * B - start]
            for k, got in enumerate(block_checksums(inner, B, self.algo)):
                self.check(b0 + 1 + k, got, crcs, rel, index)
        if b1 != b0:
            edge(b1)

    def check_tile(self, t: int, got: int, sums: list[int], rel: str, index: MetadataIndex) -> None:
        """Check tile ``t``'s checksum (:mod:`ucp_dcp.storage.tiles`)."""
        if t < len(sums) and got == sums[t]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: tile {t} has "
            f"{digest_name(self.algo)} {got:#x}, saved {f'{sums[t]:#x}' if t < len(sums) else 'none'}",
            atom=index.fqn,
            saved=sums[t] if t < len(sums) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )

    def check(self, b: int, got: int, crcs: BlockSums, rel: str, index: MetadataIndex) -> None:
        sums = crcs.sums
        if b < len(sums) and got == sums[b]:
            return
        raise ChecksumError(
            f"checksum mismatch in {rel}, atom '{index.fqn}' chunk at {list(index.offset or ())}: block {b} "
            f"(bytes {b * crcs.block}.. of the chunk) has {digest_name(self.algo)} {got:#x}, saved "
            f"{f'{sums[b]:#x}' if b < len(sums) else 'none'}",
            atom=index.fqn,
            saved=sums[b] if b < len(sums) else None,
            wanted=got,
            hint="the checkpoint file is corrupt (disk, copy or transfer error); restore it from a good copy",
        )


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
