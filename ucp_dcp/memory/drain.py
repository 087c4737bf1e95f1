"""Draining a complete memory generation to durable storage, in the background.

The durable copy is an ordinary ucp_dcp checkpoint folder (the same data files, sidecar and
``.metadata``), loadable with ``UCPFileSystemReader`` or ``ucp_dcp.load`` by anyone, on a local folder or
an object store (``s3://bucket/run``). Where it goes is the :class:`DrainTarget`'s layout: ``gen``,
``<durable>/gen-<n>/`` (the tier's own numbering), or ``step``, ``<durable>/step-<step>/`` (torchtitan's
step folders, so the manager's resume and ``keep_latest_k`` see drained steps as its own).

Each rank copies the files it wrote from its host's memory (fsynced on disk; one upload each on a store);
the ranks then agree that every copy succeeded, and only then the coordinator commits, with the same
commit point as a direct save: the ``.metadata`` rename on disk (after checking every data file's size),
one ``PUT`` of ``.metadata`` on a store (:func:`~ucp_dcp.storage.object_commit.commit_objects`, which HEADs
every data object first). A drain that dies or fails leaves data files without ``.metadata``, which no
loader takes for a checkpoint. A drain never writes into a folder that is already a committed checkpoint
(the manager's durable save of the same step, or an earlier job's): that generation is not drained.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from ..errors import IncompleteCheckpointError, UCPError
from ..storage.commit import METADATA, commit
from ..storage.object_commit import commit_objects, size_shortfalls
from ..storage.object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol
from .replicate import Generation, writer_rank

__all__ = ["DrainLayout", "DrainTarget", "durable_dir", "durable_generations", "drain_files", "commit_drain"]
__all__ += ["prune_durable", "drain_wanted"]

DrainLayout = Literal["gen", "step"]
"""``gen``: ``<durable>/gen-<n>`` (numbered by generation); ``step``: ``<durable>/step-<step>`` (torchtitan's)."""
_GEN = re.compile(r"^gen-(\d+)$")
_CHUNK = 8 << 20  # bytes per read while uploading a file to a store


@dataclass(frozen=True)
class DrainTarget:
    """Where complete generations are drained."""

    url: str
    """A local folder or an object-store URL (``s3://bucket/run``)."""
    layout: DrainLayout = "gen"
    """How a generation's folder is named under ``url`` (:data:`DrainLayout`)."""

    @property
    def on_store(self) -> bool:
        return object_protocol(self.url) in OBJECT_PROTOCOLS

    def folder(self, g: Generation) -> str:
        """The durable folder (or prefix) of generation ``g``."""
        if self.layout == "step":
            if g.step is None:
                raise UCPError(f"memory generation {g.gen} has no step: a step-layout drain needs save(step=...)")
            name = f"step-{g.step}"
        else:
            name = f"gen-{g.gen:08d}"
        return f"{self.url.rstrip('/')}/{name}" if self.on_store else os.path.join(self.url, name)

    def committed(self, folder: str) -> bool:
        """Does ``folder`` hold a commit point (asked by name: one HEAD on a store)?"""
        if self.on_store:
            return ObjectStore(folder).size(f"{folder}/{METADATA}") is not None
        return os.path.isfile(os.path.join(folder, METADATA))


def durable_dir(durable: str, gen: int) -> str:
    return os.path.join(durable, f"gen-{gen:08d}")


def durable_folders(durable: str | None) -> list[int]:
    """Generations with a local durable folder, committed or not (a drain that died leaves one), ascending."""
    if not durable or object_protocol(durable) in OBJECT_PROTOCOLS:
        return []  # the gen layout's numbering and pruning are local; a store is drained in the step layout
    try:
        names = os.listdir(durable)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _GEN.match(n)))


def durable_generations(durable: str | None) -> list[int]:
    """Generations with a committed durable copy (``.metadata`` in place), ascending."""
    return [
        g for g in durable_folders(durable) if os.path.exists(os.path.join(durable_dir(durable or "", g), METADATA))
    ]


def prune_durable(durable: str, committed: int, keep: int) -> list[int]:
    """After generation ``committed`` was committed: drop committed generations beyond the newest ``keep``,
    and every uncommitted folder older than ``committed`` (a drain that died before its commit: no
    drain of it is running, only one is ever in flight). Returns the generations removed."""
    done = durable_generations(durable)
    kept = set(done[-keep:]) if keep > 0 else set(done)
    gone = [g for g in durable_folders(durable) if g not in kept and (g in done or g < committed)]
    for g in gone:
        shutil.rmtree(durable_dir(durable, g), ignore_errors=True)
    return gone


def drain_wanted(g: Generation, target: DrainTarget, group: dist.ProcessGroup) -> bool:
    """Collective: False when the target folder is already a committed checkpoint (never overwritten:
    the copy there is a checkpoint of its own), asked once by the coordinator."""
    box: list = [None]
    failed: BaseException | None = None
    if dist.get_rank() == g.hosts.ranks[0]:
        try:
            box = [not target.committed(target.folder(g))]
        except Exception as e:  # the store cannot be asked: every rank ends the drain
            failed, box = e, [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(box, src=g.hosts.ranks[0], group=group)
    if failed is not None:
        raise failed
    if isinstance(box[0], str):
        raise UCPError(f"memory generation {g.gen}: the coordinator could not check the drain's folder: {box[0]}")
    return bool(box[0])


def drain_files(g: Generation, target: DrainTarget) -> None:
    """Copy the data files this rank wrote from host memory to the durable folder (fsynced on disk)."""
    me = dist.get_rank()
    src = g.folder(g.hosts.host_of(me))
    dst = target.folder(g)
    store = ObjectStore(dst) if target.on_store else None
    if store is None:
        os.makedirs(dst, exist_ok=True)
    for name in sorted(g.files):
        if writer_rank(name, g.hosts) != me:
            continue
        if store is not None:
            with open(os.path.join(src, name), "rb") as f, store.open_write(store.join(name)) as out:
                while chunk := f.read(_CHUNK):
                    out.write(chunk)
            continue
        tmp = os.path.join(dst, f"{name}.drain")
        shutil.copyfile(os.path.join(src, name), tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(dst, name))


def commit_drain(g: Generation, target: DrainTarget, group: dist.ProcessGroup, keep: int, ok: bool = True) -> bool:
    """Collective, after every rank copied its files (``ok``: this rank's copy succeeded): when all did,
    the coordinator commits the durable copy (gen layout: then drops durable generations beyond the
    newest ``keep`` and the leftovers of drains that died, :func:`prune_durable`; the step layout's
    folders are the manager's ``keep_latest_k``'s). Returns whether every rank's copy succeeded; a
    commit that fails raises the same error on every rank."""
    got: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, ok, group=group)
    if not all(got):
        return False
    box: list = [None]
    failed: BaseException | None = None
    if dist.get_rank() == g.hosts.ranks[0]:
        try:
            _commit(g, target, keep)
        except Exception as e:  # our refusal, or the store's or the file system's own error
            failed, box = e, [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(box, src=g.hosts.ranks[0], group=group)
    if failed is not None:
        raise failed
    if box[0] is not None:
        raise UCPError(f"memory generation {g.gen}: the drain's commit failed on the coordinator: {box[0]}")
    return True


def _commit(g: Generation, target: DrainTarget, keep: int) -> None:
    folder = target.folder(g)
    if target.on_store:
        commit_objects(ObjectStore(folder), g.md, g.sidecar, dict(g.files))
        return
    _check_sizes(folder, g)
    commit(folder, g.md, g.sidecar, set(g.files), sync=True)
    if target.layout == "gen":
        prune_durable(target.url, g.gen, keep)


def _check_sizes(folder: str, g: Generation) -> None:
    """Every data file of the generation is in the durable folder at its size (before the commit point)."""

    def size(name: str) -> int | None:
        try:
            return os.path.getsize(os.path.join(folder, name))
        except FileNotFoundError:
            return None

    short = size_shortfalls(g.files, size)
    if short:
        raise IncompleteCheckpointError(
            f"memory generation {g.gen}: {len(short)} drained file(s) are not in {folder} as written: "
            f"{', '.join(short[:4])}; the drain did not commit (the previous durable copy is unchanged)",
            saved=short,
            wanted=sorted(g.files),
            hint="something removed files from the durable folder during the drain; the next drain retries",
        )
