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
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IO_KEY", "BLOCK", "TensorRecord", "parse_tensor_record", "box_runs", "merge_intervals",
           "block_checksums", "blocks_touching"]

IO_KEY = "__ucp_io__"
"""Reserved ``MetadataIndex.fqn`` of the ``Metadata.storage_data`` entry holding ucp_dcp's I/O
information (per-item tensor data offsets and checksums); builtins only."""
BLOCK = 1 << 20
"""Checksum block: 1 MiB of tensor bytes."""


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
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class _MetaUnpickler(pickle.Unpickler):
    """Reads a torch.save ``data.pkl`` without touching storages: returns the rebuild arguments."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *a: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return torch.storage._get_dtype_from_pickle_storage_type(name)
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8",
                                          "int8", "int16", "bool", "complex64", "complex128"):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a tensor record")

    def persistent_load(self, pid):
        return pid


def parse_tensor_record(item: io.IOBase) -> TensorRecord | None:
    """Layout of the tensor inside one ``torch.save`` item (a seekable view of it), or None when
    it is not a plain tensor record we can read by ranges."""
    try:
        reader = torch._C.PyTorchFileReader(item)
        meta = _MetaUnpickler(io.BytesIO(reader.get_record("data.pkl"))).load()
    except Exception:
        return None
    if not (isinstance(meta, tuple) and len(meta) == 5 and meta[0] == "tensor"):
        return None
    _, storage, offset, size, stride = meta
    _, dtype, key, _, _ = storage
    if not isinstance(dtype, torch.dtype):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    expect = tuple(int(math.prod(size[d + 1:])) for d in range(len(size)))
    contiguous = all(s == e for s, e, n in zip(stride, expect, size) if n > 1)
    data_offset = reader.get_record_offset(f"data/{key}") + int(offset) * itemsize
    return TensorRecord(data_offset, dtype, tuple(int(s) for s in size), contiguous)


def box_runs(shape: Sequence[int], itemsize: int, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, int]:
    """Byte runs of a box of a row-major chunk: ``(starts, run_length)``, starts in row-major box
    order (so the runs, concatenated, are the box's elements in row-major order)."""
    ndim = len(shape)
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), itemsize
    if any(n == 0 for n in sizes):
        return np.zeros(0, dtype=np.int64), 0
    # innermost dims covered in full collapse into one run
    k = ndim - 1
    while k > 0 and offsets[k] == 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    run = sizes[k] * strides[k] * itemsize
    base = offsets[k] * strides[k]
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k - 1, -1, -1):
        idx = (offsets[d] + np.arange(sizes[d], dtype=np.int64)) * strides[d]
        starts = (idx[:, None] + starts[None, :]).reshape(-1)
    return starts * itemsize, run


def merge_intervals(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Union of ``[start, start + length)`` intervals, merged when they touch or overlap."""
    if len(starts) == 0:
        return []
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], starts[order] + lengths[order]
    out: list[tuple[int, int]] = []
    cur_s, cur_e = int(s[0]), int(e[0])
    for a, b in zip(s[1:].tolist(), e[1:].tolist()):
        if a <= cur_e:
            cur_e = max(cur_e, b)
        else:
            out.append((cur_s, cur_e - cur_s))
            cur_s, cur_e = a, b
    out.append((cur_s, cur_e - cur_s))
    return out


def block_checksums(data: memoryview, block: int = BLOCK) -> list[int]:
    """CRC32 of every ``block``-byte block of ``data`` (the last one may be shorter)."""
    return [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)] or [zlib.crc32(b"")]


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
