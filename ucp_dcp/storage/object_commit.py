"""Atomic commit of a checkpoint on an object store, where there is no rename.

The local commit (:mod:`ucp_dcp.storage.commit`) renames ``.metadata`` into place. On S3, GCS or Azure a
rename is a copy followed by a delete, not atomic, but writing one object is: a ``GET`` returns the old
bytes or the new ones, never a mix. The commit is therefore built from single-object writes:

1. every rank uploads its data objects under names no other save uses (``__<rank>_<token>_<n>.distcp``,
   ``token`` random per rank and save), so the checkpoint being replaced keeps all of its objects;
2. the coordinator writes the integrity sidecar ``.ucp.<xxh3-128 of .metadata>.json`` (sizes of every
   data object, the whole metadata as JSON, every checksum), then checks with one ``HEAD`` per data
   object that each object the sidecar names exists with the size written (never with a listing,
   which may miss an object written a moment ago);
3. **the commit point is one ``PUT`` of ``.metadata``** (DCP's own metadata object, so DCP's
   ``FsspecReader`` reads the result): before it, a reader opens the previous ``.metadata``, its
   sidecar and its objects, all untouched; after it, the new ones, all written before it;
4. only then are stale objects removed: data objects and sidecars the new ``.metadata`` does not name
   (the replaced checkpoint's, pieces of saves that died) and multipart uploads such saves left open.
   The set kept is the committed generation's, from its sidecar, not from a listing: a listing that
   misses an object can leave a stale one for the next save, never remove one the commit names. A
   clean-up the store refuses (deletes denied, uploads not listed) is a ``StaleObjectsWarning``, not a
   failed save: the commit has happened.

A save killed at any request before step 3 leaves the previous checkpoint loadable and its own objects
as strays (reported by ``inspect``, removed by the next save); one killed after step 3 leaves the new
checkpoint. Reading resolves ``.metadata`` and the sidecar by name (:func:`~ucp_dcp.storage.commit.open_checkpoint`),
so a load never depends on a listing either.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from ..errors import IncompleteCheckpointError, StaleObjectsWarning, StorageAccessError
from .commit import _DATA, _SIDECAR, _TMP, METADATA
from .object_store import ObjectStore
from .sidecar import metadata_hash, sidecar_name

__all__ = ["commit_objects", "size_shortfalls"]


def size_shortfalls(files: dict[str, int], size: Callable[[str], int | None]) -> list[str]:
    """The files of ``files`` (name -> bytes written) whose ``size`` (None: missing) is not what was written,
    described for an error; checked before a commit point (on a store, or a drain's durable folder)."""
    short = []
    for name, want in sorted(files.items()):
        have = size(name)
        if have != want:
            short.append(f"{name} ({'missing' if have is None else f'{have} bytes'}, {want} written)")
    return short


def commit_objects(store: ObjectStore, md_bytes: bytes, sidecar: bytes, files: dict[str, int]) -> list[str]:
    """Commit ``.metadata`` (the pickle ``md_bytes``) with its ``sidecar`` over whatever checkpoint the
    prefix holds, ``files`` (data object -> size) being what the ranks uploaded. Returns what the
    clean-up removed (stale objects and aborted multipart uploads)."""
    side = sidecar_name(metadata_hash(md_bytes))
    store.put(store.join(side), sidecar)  # the integrity record, before the commit point
    short = size_shortfalls(files, lambda name: store.size(store.join(name)))
    if short:
        # a rank's upload reported done but the store does not hold it: committing would publish a
        # checkpoint with holes; the previous one stays the checkpoint
        raise IncompleteCheckpointError(
            f"{len(short)} data object(s) of this save are not in {store.url} as written: {', '.join(short[:4])}"
            f"{', ...' if len(short) > 4 else ''}; the save did not commit (the previous checkpoint is unchanged)",
            saved=short,
            wanted=sorted(files),
            hint="check the store's health and retry the save",
        )
    store.put(store.join(METADATA), md_bytes)  # the commit point: one single-object write
    keep = set(files) | {side, METADATA}
    removed: list[str] = []
    try:
        for name in store.names() or []:
            if name in keep:
                continue
            if _DATA.match(name) or _SIDECAR.match(name) or _TMP.match(name):
                if store.remove(store.join(name)):
                    removed.append(name)
        removed += [f"{k} (multipart upload)" for k in store.abort_uploads(keep)]
    except StorageAccessError as e:
        # the checkpoint is committed; failing the save now would make a job retry one that succeeded
        warnings.warn(
            f"the checkpoint in {store.url} is committed, but removing what earlier saves left failed after "
            f"{len(removed)} removal(s): {e}. Stale objects or open multipart uploads stay (billed, never "
            "loaded; `python -m ucp_dcp inspect` lists them); allow DELETE and ListMultipartUploads on the "
            "prefix, or set a lifecycle rule that aborts incomplete uploads",
            StaleObjectsWarning,
            stacklevel=2,
        )
    return removed
