"""The integrity sidecar: DCP's metadata in a format that cannot run code, and checksums of it.

DCP's ``.metadata`` is a pickle, and unpickling a file from elsewhere can run code. Next to it
``UCPFileSystemWriter`` writes ``.ucp.<H>.json``, where ``H`` is the XXH3-128 of the ``.metadata``
bytes it belongs to. The sidecar holds the whole ``Metadata`` as JSON (tables, catalog, I/O table
with every block checksum) plus the size of every data file, and ends with a line holding the
XXH3-128 of everything before it. ``UCPFileSystemReader`` never unpickles a checkpoint that has
a sidecar: it hashes ``.metadata``, opens the sidecar of that hash, checks the sidecar's own hash
and rebuilds ``Metadata`` from the JSON. A flip in either file is therefore a clear error, and
stock tools keep reading ``.metadata`` as before.

Checkpoints without a sidecar (stock DCP) are read through :class:`SafeUnpickler`, which builds only
DCP's metadata classes, ``torch.Size``, dtypes and builtins.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import PurePath, PurePosixPath
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .._compat import _StorageInfo
from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..layout.placements import dtype_from_name, dtype_name
from .format import IO_KEY

__all__ = [
    "SIDECAR_PREFIX",
    "SIDECAR_SUFFIX",
    "FORMAT",
    "sidecar_name",
    "metadata_hash",
    "encode_sidecar",
    "decode_sidecar",
    "SafeUnpickler",
    "safe_unpickle",
]

SIDECAR_PREFIX = ".ucp."
SIDECAR_SUFFIX = ".json"
FORMAT = "ucp-dcp.sidecar"
VERSION = 1


def metadata_hash(data: bytes | memoryview) -> str:
    """XXH3-128 (hex) of a ``.metadata`` file's bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def sidecar_name(md_hash: str) -> str:
    """File name of the sidecar that belongs to the ``.metadata`` with hash ``md_hash``."""
    return f"{SIDECAR_PREFIX}{md_hash}{SIDECAR_SUFFIX}"


# -- builtins <-> JSON, with tuples, non-string keys and bytes tagged ---------------------------------


def _enc(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_enc(v) for v in x]
    if isinstance(x, tuple):
        return {"~t": [_enc(v) for v in x]}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("~") for k in x):
            return {k: _enc(v) for k, v in x.items()}
        return {"~d": [[_enc(k), _enc(v)] for k, v in x.items()]}
    if isinstance(x, (bytes, bytearray)):
        return {"~b": base64.b64encode(bytes(x)).decode()}
    raise TypeError(type(x).__name__)


def _dec(x: Any) -> Any:
    if isinstance(x, list):
        return [_dec(v) for v in x]
    if isinstance(x, dict):
        if "~t" in x:
            return tuple(_dec(v) for v in x["~t"])
        if "~d" in x:
            return {_dec(k): _dec(v) for k, v in x["~d"]}
        if "~b" in x:
            return base64.b64decode(x["~b"])
        return {k: _dec(v) for k, v in x.items()}
    return x


def _dtype(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except ValueError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in the checkpoint's sidecar") from None


# -- Metadata <-> sidecar -----------------------------------------------------------------------------


def encode_sidecar(md: Metadata, md_bytes: bytes, files: dict[str, int]) -> bytes:
    """The sidecar for ``md`` (whose pickle is ``md_bytes``) and its data ``files`` (name -> size)."""
    state = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            state.append(
                [
                    fqn,
                    dtype_name(smd.properties.dtype),
                    list(smd.size),
                    [[list(c.offsets), list(c.sizes)] for c in smd.chunks],
                ]
            )
        else:
            state.append([fqn])
    storage, io_table = [], None
    for index, info in (md.storage_data or {}).items():
        if index.fqn == IO_KEY:
            io_table = info
            continue
        storage.append(
            [
                index.fqn,
                None if index.offset is None else list(index.offset),
                str(info.relative_path),
                int(info.offset),
                int(info.length),
                list(info.transform_descriptors or []),
            ]
        )
    try:
        planner_data: Any = _enc(md.planner_data)
    except TypeError:
        planner_data = {"~pickle": True}  # a foreign planner's objects: read from the (hash-checked) pickle
    sm = md.storage_meta
    body = {
        "format": FORMAT,
        "version": VERSION,
        "metadata": {"xxh3_128": metadata_hash(md_bytes), "bytes": len(md_bytes)},
        "files": dict(sorted(files.items())),
        "dcp_version": md.version,
        "state": state,
        "storage": storage,
        "io": io_table,
        "planner_data": planner_data,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules or []),
        },
    }
    text = json.dumps(body, separators=(",", ":")).encode()
    return text + b"\n" + json.dumps({"xxh3_128": xxhash.xxh3_128_hexdigest(text)}).encode() + b"\n"


def decode_sidecar(data: bytes, name: str) -> dict[str, Any]:
    """Parse and self-check a sidecar's bytes; returns its body (raises on any damage)."""
    text, _, tail = data.rstrip(b"\n").rpartition(b"\n")
    try:
        want = json.loads(tail)["xxh3_128"]
    except Exception:  # a damaged tail (not JSON, no key): no recorded hash, so the check below raises
        want = None
    got = xxhash.xxh3_128_hexdigest(text)
    if want != got:
        raise CorruptCheckpointError(
            f"integrity record {name} is damaged: its contents hash to {got}, recorded {want}",
            saved=want,
            wanted=got,
            hint="the sidecar file is corrupt (disk, copy or transfer error); restore the checkpoint from a good copy",
        )
    body = json.loads(text)
    if body.get("format") != FORMAT or not isinstance(body.get("version"), int) or body["version"] > VERSION:
        raise CorruptCheckpointError(
            f"{name} is not a ucp-dcp sidecar this version can read (format {body.get('format')!r}, "
            f"version {body.get('version')!r})",
            hint="upgrade ucp_dcp",
        )
    return body


def metadata_from_sidecar(body: dict[str, Any], md_bytes: bytes | None, trust: bool = False) -> Metadata:
    """Rebuild DCP's ``Metadata`` from a sidecar body (no unpickling unless the planner data needs it)."""
    state: dict[str, Any] = {}
    for row in body["state"]:
        if len(row) == 1:
            state[row[0]] = BytesStorageMetadata()
            continue
        fqn, dtype, size, chunks = row
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_dtype(dtype)),
            size=torch.Size(size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
        )
    storage: dict[MetadataIndex, Any] = {}
    for fqn, offset, rel, off, length, transforms in body["storage"]:
        storage[MetadataIndex(fqn, None if offset is None else torch.Size(offset))] = _StorageInfo(
            rel, off, length, transforms or None
        )
    if body.get("io") is not None:
        storage[MetadataIndex(IO_KEY)] = body["io"]
    planner_data = body.get("planner_data")
    if isinstance(planner_data, dict) and planner_data.get("~pickle"):
        planner_data = safe_unpickle(md_bytes or b"", trust=trust).planner_data
    else:
        planner_data = _dec(planner_data)
    sm = body.get("storage_meta")
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=None
        if sm is None
        else StorageMeta(
            checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], load_id=sm["load_id"], modules=sm["modules"]
        ),
        version=body.get("dcp_version"),
    )


# -- stock .metadata without a sidecar ----------------------------------------------------------------

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP_META, n): getattr(__import__(_DCP_META, fromlist=[n]), n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("collections", "OrderedDict")] = __import__("collections").OrderedDict
# checkpoint_id is often a Path: rebuilt as a pure path (no filesystem access)
_ALLOWED.update({("pathlib", n): PurePosixPath for n in ("PosixPath", "PurePosixPath", "Path")})
_ALLOWED.update({("pathlib", n): PurePath for n in ("WindowsPath", "PureWindowsPath")})


def _layout(name: str) -> Any:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return value


class SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata building only an allow-list of types: DCP's metadata dataclasses,
    ``torch.Size``, dtypes, layouts, memory formats, paths and builtins. Anything else (the way a
    crafted pickle runs code) raises ``pickle.UnpicklingError``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "builtins" and name in ("set", "frozenset", "complex", "slice", "range"):
            return getattr(__import__("builtins"), name)
        raise pickle.UnpicklingError(f"'{module}.{name}' is not a type DCP metadata is made of")


def safe_unpickle(data: bytes | memoryview, *, trust: bool = False, where: str = ".metadata") -> Metadata:
    """``Metadata`` from a ``.metadata`` pickle; a plain unpickle only with ``trust=True``."""
    if trust:
        return pickle.loads(data)
    try:
        md = SafeUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{where} refers to something outside the types DCP metadata is made of ({e}): "
            "unpickling it could run code",
            hint="open it with trust=True only if you trust where the checkpoint came from "
            "(ucp_dcp.load(..., trust=True), UCPFileSystemReader(path, trust=True), `inspect --trust`)",
        ) from None
    except Exception as e:  # truncated or damaged pickles
        raise CorruptCheckpointError(
            f"{where} does not parse as DCP metadata ({type(e).__name__}: {e})",
            hint="the file is damaged; restore it from a good copy",
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(md).__name__}, not DCP Metadata")
    return md
