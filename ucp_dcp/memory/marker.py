"""The completion marker of a memory generation: written last, on every host, once every piece has
its replicas.

``.complete.json`` is builtins-only JSON ending with a line that holds the XXH3-128 of everything
before it (as the integrity sidecar does), so a damaged marker is refused, never half-trusted. It is
bound to the generation's commit (the ``.metadata`` hash) and lists every data file of the
generation with its size and XXH3-128, and the hosts holding each: a loader checks the bytes it has
against it before it plans (a corrupt or missing replica is found there, not mid-load).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError

__all__ = ["MARKER", "Marker", "encode_marker", "decode_marker", "write_marker", "read_marker", "file_hash"]

MARKER = ".complete.json"
FORMAT = "ucp-dcp.memory-generation"
VERSION = 1


@dataclass(frozen=True)
class Marker:
    """A complete generation, as its completion marker records it."""

    generation: int
    """Generation number (one per memory save, ascending across restarts)."""
    metadata_hash: str
    """XXH3-128 of the generation's ``.metadata`` (the commit the marker completes)."""
    files: dict[str, tuple[int, str]]
    """Every data file: ``(size, xxh3_128 hex)``."""
    holders: dict[str, list[str]]
    """Every data file: the hosts holding it (its writer's host first, then its replicas)."""
    replicas: int
    """Copies on other hosts each file was given (k)."""
    step: int | None = None
    """The training step the caller saved at, when it said."""


def file_hash(path: str) -> str:
    """XXH3-128 (hex) of a file's bytes, read in 8 MiB pieces."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def encode_marker(m: Marker) -> bytes:
    body = {
        "format": FORMAT,
        "version": VERSION,
        "generation": m.generation,
        "metadata": m.metadata_hash,
        "files": {k: [v[0], v[1]] for k, v in sorted(m.files.items())},
        "holders": {k: list(v) for k, v in sorted(m.holders.items())},
        "replicas": m.replicas,
        "step": m.step,
    }
    text = json.dumps(body, sort_keys=True).encode()
    return text + b"\n" + xxhash.xxh3_128_hexdigest(text).encode() + b"\n"


def decode_marker(data: bytes, where: str) -> Marker:
    """The marker in ``data``; :class:`CorruptCheckpointError` if it is damaged or not a marker."""
    text, _, tail = data.rstrip(b"\n").rpartition(b"\n")
    if not text or xxhash.xxh3_128_hexdigest(text).encode() != tail.strip():
        raise CorruptCheckpointError(
            f"the completion marker {where} is damaged (its own checksum does not match)",
            hint="this host's copy of the generation cannot be trusted; another host's, or the durable copy, is used",
        )
    try:
        body: Any = json.loads(text)
        if body.get("format") != FORMAT or int(body["version"]) > VERSION:
            raise ValueError(f"format {body.get('format')!r} version {body.get('version')!r}")
        return Marker(
            int(body["generation"]),
            str(body["metadata"]),
            {str(k): (int(v[0]), str(v[1])) for k, v in body["files"].items()},
            {str(k): [str(h) for h in v] for k, v in body["holders"].items()},
            int(body["replicas"]),
            None if body.get("step") is None else int(body["step"]),
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"the completion marker {where} is not one this ucp_dcp reads: {e}",
            hint="upgrade ucp_dcp, or load the durable copy",
        ) from None


def write_marker(folder: str, m: Marker) -> None:
    """Write the marker under a temporary name and rename it into place (a reader sees all or nothing)."""
    tmp = os.path.join(folder, f"{MARKER}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(encode_marker(m))
    os.replace(tmp, os.path.join(folder, MARKER))


def read_marker(folder: str) -> Marker | None:
    """The folder's marker (None: there is none); a damaged one raises :class:`CorruptCheckpointError`."""
    path = os.path.join(folder, MARKER)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return decode_marker(data, path)
