"""The safetensors file format, read and written without the ``safetensors`` package.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then
the tensors' raw row-major bytes, ``data_offsets`` relative to the end of the header. That makes a
box of a tensor a set of byte runs, exactly like a chunk ucp_dcp wrote itself (see
:mod:`ucp_dcp.storage.format`). A header is untrusted input: it is parsed as JSON only (nothing can
run), bounded in size, and every tensor must lie inside the data section with the size its dtype
and shape imply, without overlapping another.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptCheckpointError, TruncatedFileError

__all__ = ["DTYPES", "TensorInfo", "SafetensorsFile", "read_header", "encode_header", "dtype_code"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype codes and their torch dtypes."""
_CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20
"""Largest header accepted (the safetensors library's own limit)."""


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in _CODES:
        raise CorruptCheckpointError(
            f"dtype {dtype} has no safetensors code",
            saved=str(dtype),
            hint=f"convert to one of {sorted(str(d) for d in _CODES)}",
        )
    return _CODES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file."""

    name: str
    """Its name in the file (Hugging Face's parameter name)."""
    dtype: torch.dtype
    """Element type as stored."""
    shape: tuple[int, ...]
    """Logical shape (row-major, contiguous)."""
    offset: int
    """Absolute byte offset of element 0 in the file."""
    nbytes: int
    """Bytes of data."""


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed header: where each tensor is, and how large the file must be."""

    tensors: dict[str, TensorInfo]
    """Tensors by name."""
    size: int
    """Bytes the file must have (header plus the end of the last tensor)."""
    metadata: dict[str, str]
    """The header's ``__metadata__`` (strings only)."""


def read_header(path: str | os.PathLike) -> SafetensorsFile:
    """Parse and validate the header of the safetensors file at ``path`` (reads only the header)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TruncatedFileError(
                f"{path} is not a safetensors file: {len(head)} bytes", hint="the file is truncated or not safetensors"
            )
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise CorruptCheckpointError(
                f"{path}: header of {n} bytes (over {MAX_HEADER})", hint="the file is damaged or not safetensors"
            )
        raw = f.read(n)
        have = os.fstat(f.fileno()).st_size
    if len(raw) < n:
        raise TruncatedFileError(
            f"{path}: the header is cut off ({len(raw)} of {n} bytes)", hint="the file is truncated; download it again"
        )
    return parse_header(raw, str(path), have)


def parse_header(raw: bytes, where: str, file_size: int | None = None) -> SafetensorsFile:
    """Validate a header's JSON bytes; ``file_size`` (when known) must cover every tensor."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(
            f"{where}: the safetensors header is not JSON ({e})", hint="the file is damaged or not safetensors"
        ) from None
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{where}: the safetensors header is not a JSON object")
    meta = body.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptCheckpointError(f"{where}: __metadata__ must map strings to strings")
    base = 8 + len(raw)
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, rec in body.items():
        bad = _check_record(rec)
        if bad:
            raise CorruptCheckpointError(
                f"{where}: tensor '{name}': {bad}",
                atom=name,
                hint="the file is damaged or was not written by a safetensors writer",
            )
        dtype = DTYPES[rec["dtype"]]
        shape = tuple(rec["shape"])
        begin, end = rec["data_offsets"]
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise CorruptCheckpointError(
                f"{where}: tensor '{name}' {rec['dtype']}{list(shape)} needs {want} bytes, "
                f"its data_offsets span {end - begin}",
                atom=name,
                saved=end - begin,
                wanted=want,
                hint="the file is damaged",
            )
        tensors[name] = TensorInfo(name, dtype, shape, base + begin, want)
        spans.append((begin, end, name))
    spans.sort()
    for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CorruptCheckpointError(
                f"{where}: tensors '{n0}' and '{n1}' overlap in the file",
                atom=n1,
                hint="the file is damaged or crafted",
            )
    size = base + max((e for _, e, _ in spans), default=0)
    if file_size is not None and file_size < size:
        raise TruncatedFileError(
            f"{where} has {file_size} bytes, its header describes {size}",
            saved=size,
            wanted=file_size,
            hint="the file is truncated; download it again",
        )
    return SafetensorsFile(tensors, size, dict(meta))


def _check_record(rec: Any) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("dtype") not in DTYPES:
        return f"unknown dtype {rec.get('dtype')!r}"
    shape = rec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        return f"bad shape {shape!r}"
    offs = rec.get("data_offsets")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        or not 0 <= offs[0] <= offs[1]
    ):
        return f"bad data_offsets {offs!r}"
    return None


def encode_header(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None, align: int = 8
) -> tuple[bytes, dict[str, int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order, and each
    tensor's absolute offset in the file. The header is padded with spaces to ``align`` bytes, as
    the safetensors library does, so the data is aligned for every dtype."""
    body: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    pos = 0
    rel: dict[str, int] = {}
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        body[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [pos, pos + n]}
        rel[name] = pos
        pos += n
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    head = struct.pack("<Q", len(raw)) + raw
    return head, {k: len(head) + v for k, v in rel.items()}
