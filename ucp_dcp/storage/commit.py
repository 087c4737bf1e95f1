"""Atomic commit of a checkpoint folder, and telling a committed checkpoint from pieces of a save.

A save never touches the files of the checkpoint it replaces. Data files get names no earlier save
used (``__<rank>_<token>_<n>.distcp``, ``token`` random per rank and save); the coordinator then
writes the sidecar (:mod:`ucp_dcp.storage.sidecar`) and ``.metadata`` under temporary names, fsyncs them,
and **renames ``.metadata`` into place: that rename is the commit**. The folder is fsynced, and only
then are files that the new metadata does not reference removed (the old checkpoint's, and pieces
of earlier saves that died). A save that dies at any point before the rename leaves the previous
checkpoint as it was; one that dies after it leaves the new checkpoint plus stray files that the
next save removes. A removal refused after the commit (a folder whose old files the job may not delete)
is a ``StaleObjectsWarning``, never a failed save: the new checkpoint is committed.

:func:`open_checkpoint` is the reading side: it finds ``.metadata``, verifies it against its
sidecar, and names what is wrong when a folder holds no committed checkpoint. Each sidecar is bound
to the ``.metadata`` bytes it was committed with (their hash is its name and is recorded inside it);
a ``.metadata`` that matches none of them is refused when anything in it says our writer committed
it (catalog, I/O table, data files a record lists: then it was damaged or rewritten), and is
otherwise the checkpoint another writer (stock ``dcp.save``) saved over ours: it opens unverified.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StaleObjectsWarning,
    UnsafeCheckpointError,
)
from ..planning.catalog import CATALOG_KEY
from ..planning.opened import IntegrityStatus
from .format import IO_KEY, digest_name
from .object_store import refused
from .sidecar import decode_sidecar, metadata_from_sidecar, metadata_hash, safe_unpickle, sidecar_name

__all__ = ["METADATA", "new_token", "commit", "Integrity", "open_checkpoint", "scan", "DirState", "signs_of_a_record"]

logger = logging.getLogger(__name__)

METADATA = ".metadata"
_DATA = re.compile(r"^__\d+_.*\.distcp$")
_TMP = re.compile(r"^(\.metadata|\.ucp\.[0-9a-f]+\.json)\.[0-9a-f]+\.tmp$")
_SIDECAR = re.compile(r"^\.ucp\.([0-9a-f]{32})\.json$")


def new_token() -> str:
    """A fresh name component for one rank's files of one save."""
    return secrets.token_hex(4)


def _fsync_dir(path: str) -> None:
    # A rename is durable only once its folder is synced (POSIX: the entry lives in the folder, not the file).
    # Folders some file systems cannot open or sync (FUSE mounts, some network file systems) are left as they
    # are: their rename is what they offer, and refusing to commit there would refuse every save.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def commit(folder: str, md_bytes: bytes, sidecar: bytes, keep: set[str], sync: bool = True) -> list[str]:
    """Make ``.metadata`` (pickle ``md_bytes``) and its ``sidecar`` the folder's checkpoint in one
    atomic step, then remove checkpoint files not in ``keep`` (data files of the new checkpoint).
    Returns the removed names."""
    # Temporary names of this commit's own (a token): two saves racing into one folder, or a commit that died
    # half-way, never write over each other's pieces; the scan below removes a dead one's leftovers.
    token = new_token()
    side = sidecar_name(metadata_hash(md_bytes))
    side_tmp = os.path.join(folder, f"{side}.{token}.tmp")
    md_tmp = os.path.join(folder, f"{METADATA}.{token}.tmp")
    # The sidecar goes into place first: it is named by the hash of the .metadata it belongs to, so until that
    # .metadata is renamed in, no reader opens it, and a crash here leaves the old checkpoint as it was.
    _write_file(side_tmp, sidecar, sync)
    os.replace(side_tmp, os.path.join(folder, side))
    _write_file(md_tmp, md_bytes, sync)
    if sync:
        _fsync_dir(folder)  # the data files' and the sidecar's names are durable before the switch
    os.replace(md_tmp, os.path.join(folder, METADATA))  # the commit
    if sync:
        _fsync_dir(folder)
    # Only now, with the new checkpoint durable, do the old one's files go: before the second folder sync a
    # crash could bring back the old .metadata, which needs them.
    removed: list[str] = []
    refused: list[str] = []
    why: OSError | None = None
    for name in sorted(os.listdir(folder)):
        stale = (_DATA.match(name) and name not in keep) or _TMP.match(name) or (_SIDECAR.match(name) and name != side)
        if stale:
            try:
                os.remove(os.path.join(folder, name))
                removed.append(name)
            except FileNotFoundError:  # another process (a racing save's cleanup) removed it first
                pass
            except OSError as e:  # committed already: failing now would make a job retry a save that succeeded
                refused.append(name)
                why = why or e
    if removed and sync:
        _fsync_dir(folder)
    if refused:
        warnings.warn(
            f"the checkpoint in {folder} is committed, but {len(refused)} file(s) earlier saves left could not be "
            f"removed ({', '.join(refused[:3])}{', ...' if len(refused) > 3 else ''}): {why}. They stay (disk "
            "space, never loaded; `python -m ucp_dcp inspect` lists them); a later save removes them once "
            "it may",
            StaleObjectsWarning,
            stacklevel=2,
        )
    return removed


@dataclass
class DirState:
    """What a checkpoint folder holds, by file name."""

    has_metadata: bool = False
    """``.metadata`` exists."""
    sidecars: list[str] = field(default_factory=list)
    """Integrity sidecars (``.ucp.<hash>.json``)."""
    data_files: list[str] = field(default_factory=list)
    """``__*.distcp`` data files."""
    tmp_files: list[str] = field(default_factory=list)
    """Temporary files of a commit that did not finish."""


def scan(fs: Any, path: Any) -> DirState | None:
    """Classify the files of a checkpoint folder (None when the folder does not exist). On an object
    store this is a listing, which may miss objects written a moment ago: it only ever serves
    diagnostics and strays, never to find the checkpoint's own ``.metadata`` or sidecar."""
    inner = getattr(fs, "fs", None)  # DCP's fsspec FileSystem wraps an fsspec file system
    try:
        if inner is not None:
            inner.invalidate_cache(str(path))
        names = [os.path.basename(str(p).rstrip("/")) for p in fs.ls(path)]
    except (FileNotFoundError, NotADirectoryError) as e:
        if inner is not None and "bucket" in str(e).lower():
            raise refused("LIST", str(path), e) from None
        return None
    st = DirState()
    for n in sorted(names):
        if n == METADATA:
            st.has_metadata = True
        elif _SIDECAR.match(n):
            st.sidecars.append(n)
        elif _DATA.match(n):
            st.data_files.append(n)
        elif _TMP.match(n):
            st.tmp_files.append(n)
    return st


@dataclass
class Integrity:
    """How much of a checkpoint a load can verify, as found when it was opened."""

    status: IntegrityStatus
    """``"verified"``: metadata checked against its sidecar, checksums on every data byte a load
    uses; ``"partial"``: tensor checksums but unprotected metadata and values (ucp_dcp < 0.2);
    ``"none"``: no checksums (stock DCP, or a writer with ``checksums=False``)."""
    sidecar: str | None = None
    """Name of the sidecar the metadata was verified against."""
    algo: str | None = None
    """Block checksum algorithm (None: no checksums)."""
    files: dict[str, int] | None = None
    """Size of every data file as written (from the sidecar)."""
    strays: list[str] = field(default_factory=list)
    """Files that are not part of this checkpoint: an interrupted save's, or those of a ucp_dcp checkpoint
    another writer saved over (its data files and integrity records); the next ucp_dcp save removes them."""
    metadata_hash: str | None = None
    """The hash of the ``.metadata`` bytes opened (:func:`~ucp_dcp.storage.sidecar.metadata_hash`); None: not known."""

    def describe(self) -> str:
        if self.status == "verified":
            text = (
                f"verified: metadata matches {self.sidecar}; {digest_name(self.algo)} checksums on every tensor block, "
                "value and table"
            )
        elif self.status == "partial":
            text = f"partial: {digest_name(self.algo)} checksums on tensor data only (metadata and values unprotected)"
        else:
            text = "none: no checksums, nothing a load reads is verified"
        if self.strays:
            text += (
                f"; {len(self.strays)} stray file(s) of an interrupted save or of a checkpoint this one replaced "
                "(removed by the next ucp_dcp save)"
            )
        return text


def _read(fs: Any, path: Any) -> bytes:
    with fs.create_stream(path, "rb") as f:
        return f.read()


def _read_if_there(fs: Any, path: Any) -> bytes | None:
    """A file's bytes, None when it does not exist. On an object store one GET of that object,
    never an answer from a listing (or a client cache of one) that may not show it yet."""
    inner = getattr(fs, "fs", None)
    try:
        if inner is None:
            return _read(fs, path)
        return bytes(inner.cat_file(str(path)))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        if inner is not None and "bucket" in str(e).lower():
            raise refused("GET", str(path), e) from None
        return None
    except OSError as e:
        if inner is None:
            raise
        raise refused("GET", str(path), e) from None


def open_checkpoint(fs: Any, path: Any, *, trust: bool = False, list_strays: bool = True) -> tuple[Metadata, Integrity]:
    """Metadata of the checkpoint at ``path`` and how far it can be verified. Never unpickles a
    checkpoint that has a sidecar; a stock one only through the safe unpickler (unless ``trust``).
    ``list_strays=False``: no listing when ``.metadata`` and its sidecar open by name (``Integrity.strays``
    is then empty): a load on an object store skips a LIST request per rank that only diagnostics use."""
    # .metadata and its sidecar are opened by name; the listing only names what else the folder holds
    md_bytes = _read_if_there(fs, fs.concat_path(path, METADATA))
    listed = list_strays or md_bytes is None
    st = scan(fs, path) if listed else DirState(has_metadata=True)
    if st is None and md_bytes is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: the folder does not exist", hint="check the path (and that the save finished)"
        )
    st = st or DirState()
    if md_bytes is None:
        if st.data_files or st.sidecars or st.tmp_files:
            pieces = st.data_files + st.sidecars + st.tmp_files
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {path}: {len(pieces)} file(s) of a save ({', '.join(pieces[:4])}"
                f"{', ...' if len(pieces) > 4 else ''}) but no .metadata — the save that wrote them did not "
                "commit, so nothing here is a checkpoint",
                saved=pieces,
                wanted=METADATA,
                hint="load an earlier checkpoint; the next save into this folder removes these files",
            )
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: the folder holds no .metadata",
            hint="check the path (and that the save finished)",
        )
    # The sidecar is found by the hash of the .metadata bytes, never by listing: a .metadata another writer
    # saved over ours, or one damaged on disk, finds no sidecar of its own (and is judged below).
    h = metadata_hash(md_bytes)
    side = sidecar_name(h)
    side_bytes = _read_if_there(fs, fs.concat_path(path, side))
    if side_bytes is None and not listed:  # what else the folder holds decides how it opens
        st = scan(fs, path) or DirState()
    if side_bytes is not None:
        body = decode_sidecar(side_bytes, side)
        if body["metadata"] != {"xxh3_128": h, "bytes": len(md_bytes)}:
            raise CorruptCheckpointError(
                f"{side} describes another .metadata than the one in {path}",
                hint="the checkpoint is damaged; restore it from a good copy",
            )
        md = metadata_from_sidecar(body, md_bytes, trust)
        files = {k: int(v) for k, v in body["files"].items()}
        io = body.get("io") or {}
        strays = [n for n in st.data_files if n not in files] + [n for n in st.sidecars if n != side] + st.tmp_files
        # a writer with checksums=False: the tables are checked, the data cannot be
        return md, Integrity("verified" if io.get("algo") else "none", side, io.get("algo"), files, strays, h)
    if st.sidecars:
        # none of the integrity records was committed with this .metadata: a damaged or rewritten
        # one of ours (refused), or another writer's checkpoint saved over ours (loads unverified)
        return _unrecorded(fs, path, st, md_bytes, h, trust)
    md = safe_unpickle(md_bytes, trust=trust, where=f".metadata in {path}")
    io = (md.storage_data or {}).get(MetadataIndex(IO_KEY)) if isinstance(md.storage_data, dict) else None
    if isinstance(io, dict) and io.get("version", 1) >= 2:  # its own table says a sidecar was committed with it
        raise CorruptCheckpointError(
            f"the checkpoint in {path} was written with an integrity sidecar, which is missing",
            hint="copy the checkpoint's .ucp.*.json file along with it, or restore it from a good copy",
        )
    algo = io.get("algo") if isinstance(io, dict) else None
    referenced = {getattr(i, "relative_path", None) for i in (md.storage_data or {}).values()}
    strays = [n for n in st.data_files if n not in referenced] + st.tmp_files
    return md, Integrity("partial" if algo else "none", None, algo, None, strays, h)


def _unrecorded(fs: Any, path: Any, st: DirState, md_bytes: bytes, h: str, trust: bool) -> tuple[Metadata, Integrity]:
    """Open a ``.metadata`` that no integrity record in the folder was committed with: refused when
    anything in it says a ucp_dcp writer committed it (:func:`signs_of_a_record`), else the stock
    checkpoint another writer saved over ours, unverified, the old records and files its strays."""
    where = f".metadata in {path}"
    names = ", ".join(st.sidecars)
    try:
        md = safe_unpickle(md_bytes, trust=trust, where=where)
    except (CorruptCheckpointError, UnsafeCheckpointError) as e:
        raise CorruptCheckpointError(
            f"{where} matches none of its integrity records ({names}): its bytes hash to {h}, and it does not "
            f"open as DCP metadata either ({e.message})",
            saved=st.sidecars,
            wanted=h,
            hint="the file is damaged; restore the checkpoint from a good copy",
        ) from None
    listed: dict[str, str] = {}  # data file -> the record listing it
    for side in st.sidecars:
        try:
            body = decode_sidecar(_read(fs, fs.concat_path(path, side)), side)
        except CorruptCheckpointError:
            continue  # a damaged record lists nothing we can use; the signs in the metadata remain
        listed.update((f, side) for f in body.get("files", {}))
    signs = signs_of_a_record(md, listed)
    if signs:
        raise CorruptCheckpointError(
            f"{where} matches none of its integrity records ({names}): its bytes hash to {h}, yet it "
            f"{' and '.join(signs)}. It was committed with an integrity record and changed since: the file is "
            "damaged or was rewritten",
            saved=st.sidecars,
            wanted=h,
            hint="restore the checkpoint from a good copy; if you rewrote it on purpose (e.g. UCPSavePlanner "
            "through another storage writer), save through ucp_dcp.save / UCPFileSystemWriter, or delete the "
            ".ucp.*.json files to read it unverified",
        )
    referenced = {getattr(i, "relative_path", None) for i in (md.storage_data or {}).values()}
    strays = [n for n in st.data_files if n not in referenced] + st.sidecars + st.tmp_files
    return md, Integrity("none", None, None, None, strays, h)


def signs_of_a_record(md: Metadata, listed: dict[str, str]) -> list[str]:
    """What in ``md`` says a ucp_dcp writer committed it with an integrity record (empty: nothing,
    it is another writer's checkpoint). ``listed``: data file -> the integrity record that lists it.

    Three independent signs, so no single damaged byte can hide all of them: the catalog lives in
    ``planner_data``, the I/O table and the data-file names in ``storage_data``, and the stock writer
    names its files ``__<rank>_<n>.distcp``, never one of ours (``__<rank>_<token>_<n>.distcp``)."""
    signs = []
    if isinstance(md.planner_data, dict) and CATALOG_KEY in md.planner_data:
        signs.append("carries ucp_dcp's catalog")
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    if MetadataIndex(IO_KEY) in storage:
        signs.append("carries the I/O table only UCPFileSystemWriter writes (always with a record)")
    used = sorted({f for i in storage.values() if (f := getattr(i, "relative_path", None)) in listed})
    if used:
        signs.append(f"references {len(used)} data file(s) that {listed[used[0]]} lists ({', '.join(used[:3])})")
    return signs
