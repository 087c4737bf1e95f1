"""Small values of a checkpoint, read for ``inspect``: objects up to :data:`VALUE_BYTES` and tensors up to
:data:`TENSOR_ELEMS` elements, checked against their checksums and decoded with ``torch.load(weights_only=True)``
(a value holding any other type is refused, not decoded), and their JSON and text forms."""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ..errors import UCPError
from ..storage.format import BLOCK, HASHES, IO_KEY, BlockChecker, BlockSums, entry_sums, item_key
from ..storage.opening import filesystem

VALUE_BYTES = 4096
"""Largest saved object (its item's bytes) whose value is read and shown."""
TENSOR_ELEMS = 8
"""Largest tensor (elements) whose value is read and shown (only when checksummed: it is verified)."""
TEXT_CHARS = 60
"""Longest value text in the human table (longer ones are cut with '...')."""


# -- values -----------------------------------------------------------------------------------------


def _jsonable(v: Any, depth: int = 0) -> Any:
    """A JSON-able form of a decoded value (tuples become lists, other types their repr)."""
    if depth > 20:
        return "..."
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, torch.Tensor):
        return _jsonable(v.tolist(), depth + 1) if v.numel() <= TENSOR_ELEMS else _tensor_text(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x, depth + 1) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return f"<bytes, {len(v)}>"
    return repr(v)


def _num_text(v: Any) -> str:
    """Elements of a tensor value: floats to 6 significant digits."""
    if isinstance(v, list):
        return "[" + ", ".join(_num_text(x) for x in v) + "]"
    if isinstance(v, float) and math.isfinite(v):
        return repr(float(f"{v:.6g}"))
    return repr(v)


def _tensor_text(t: torch.Tensor) -> str:
    if t.numel() <= TENSOR_ELEMS:
        return f"tensor({_num_text(t.tolist())})"
    return f"<tensor {'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).removeprefix('torch.')}>"


def _text(v: Any, depth: int = 0) -> str:
    """Compact text of a decoded value (bytes and large tensors summarized)."""
    if depth > 6:
        return "..."
    if isinstance(v, torch.Tensor):
        return _tensor_text(v)
    if isinstance(v, (bytes, bytearray)):
        return f"<bytes, {len(v)}>"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_text(x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_text(x, depth + 1) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(_text(x, depth + 1) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def _cut(text: str, n: int = TEXT_CHARS) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _decode(data: bytes, name: str) -> dict[str, Any]:
    """A verified object item's value, decoded without running code."""
    if not data.startswith(b"PK\x03\x04"):  # written raw (an io.BytesIO value), not by torch.save
        return {"text": f"<bytes, {len(data)}>"}
    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported operand|Trying to [^.]*)[^\n.]*", str(e))
        why = found.group(0).strip() if found else type(e).__name__
        return {
            "refused": f"value of '{name}' holds a type outside the safe set (tensors, numbers, strings, "
            f"lists, dicts, tuples, ...): decoding it could run code ({why}); not decoded",
            "text": "<refused: type outside the safe set>",
        }
    except Exception as e:  # shown as this value's verdict in the listing; the other values still print
        return {
            "error": f"value of '{name}' does not decode ({type(e).__name__}: {str(e)[:200]})",
            "text": "<error: does not decode>",
        }
    return {"value": _jsonable(value), "text": _text(value)}


def read_values(
    path: str | os.PathLike, md: Metadata, *, max_bytes: int = VALUE_BYTES, max_elems: int = TENSOR_ELEMS
) -> dict[str, dict[str, Any]]:
    """Values of the checkpoint's small atoms, by atom: ``{"value": JSON-able, "text": short text,
    "verified": bool}``; ``{"text": "<object, N bytes>"}`` for an object over ``max_bytes``;
    ``{"error": why, "text": ...}`` when its bytes fail their checksum or cannot be read or decoded;
    ``{"refused": why, "text": ...}`` when it holds a type decoding could run code for.

    Objects (up to ``max_bytes``) are read whether or not the checkpoint has checksums (verified
    when it has); single-chunk tensors of at most ``max_elems`` elements only when their data is
    checksummed (others are left out)."""
    fs, root = filesystem(path)
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    table = storage.get(MetadataIndex(IO_KEY)) or {}
    algo = table.get("algo") if table.get("algo") in HASHES else None
    sums = table.get("items", {}) if algo else {}
    must_have = bool(sums) and int(table.get("version", 1)) >= 2  # every object has a checksum then
    block = int(table.get("block", BLOCK))  # objects' block, and every record's up to version 3
    checker = BlockChecker(algo or "")
    out: dict[str, dict[str, Any]] = {}
    jobs: dict[str, list[tuple]] = defaultdict(list)
    for name, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            index = MetadataIndex(name)
            info = storage.get(index)
            if info is None:
                out[name] = {"error": f"no storage entry for object '{name}'", "text": "<error: no storage entry>"}
                continue
            if getattr(info, "transform_descriptors", None):
                out[name] = {"text": f"<object, {info.length} bytes, transformed>"}
                continue
            if info.length > max_bytes:
                out[name] = {"text": f"<object, {info.length} bytes>"}
                continue
            entry = sums.get(item_key(index))
            if entry is None and must_have:
                out[name] = {
                    "error": f"object '{name}' has no checksum in the checkpoint's I/O table",
                    "text": "<error: no checksum>",
                }
                continue
            crcs = entry_sums(entry, block, index) if entry else None
            jobs[info.relative_path].append((info.offset, info.length, name, index, crcs, None))
        elif isinstance(smd, TensorStorageMetadata) and algo:
            numel = math.prod(int(s) for s in smd.size)
            if numel > max_elems or len(smd.chunks) != 1 or list(smd.chunks[0].sizes) != list(smd.size):
                continue
            index = MetadataIndex(name, smd.chunks[0].offsets)
            info, entry = storage.get(index), sums.get(item_key(index))
            nbytes = numel * smd.properties.dtype.itemsize
            if (
                info is None
                or entry is None
                or entry[0] < 0
                or getattr(info, "transform_descriptors", None)
                or entry[0] + nbytes > info.length
            ):
                continue
            jobs[info.relative_path].append(
                (
                    info.offset + entry[0],
                    nbytes,
                    name,
                    index,
                    entry_sums(entry, block, index),
                    (smd.properties.dtype, tuple(int(s) for s in smd.size)),
                )
            )
    for rel, todo in jobs.items():
        try:
            with fs.create_stream(fs.concat_path(root, rel), "rb") as f:
                for offset, length, name, index, crcs, tensor in sorted(todo, key=lambda j: j[0]):
                    out[name] = _read_one(f, rel, offset, length, name, index, crcs, tensor, checker)
        except (OSError, UCPError) as e:
            for job in todo:
                out.setdefault(job[2], {"error": f"cannot read {rel}: {e}", "text": "<error: cannot read>"})
    return out


def _read_one(
    f: Any,
    rel: str,
    offset: int,
    length: int,
    name: str,
    index: MetadataIndex,
    crcs: BlockSums | None,
    tensor: tuple[torch.dtype, tuple[int, ...]] | None,
    checker: BlockChecker,
) -> dict[str, Any]:
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        return {
            "error": f"{rel} ends before the bytes of '{name}': the file is truncated",
            "text": "<error: truncated>",
        }
    if crcs is not None:
        try:
            checker.verify(memoryview(data), 0, crcs, rel, index)
        except UCPError as e:
            return {"error": e.message, "text": "<error: checksum mismatch>"}
    if tensor is None:
        got = _decode(data, name)
    else:
        dtype, shape = tensor
        try:
            t = (
                torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
                if data
                else torch.empty(shape, dtype=dtype)
            )
            got = {"value": _jsonable(t.tolist()), "text": _num_text(t.tolist())}
        except Exception as e:  # a dtype without a Python form (float8, ...): say so, do not fail the summary
            return {"text": f"<tensor, {dtype}: {type(e).__name__}>"}
    if "value" in got:
        got["verified"] = crcs is not None
    return got
