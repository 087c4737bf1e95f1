"""Draining a complete memory generation to durable storage, in the background.

The durable copy of generation ``n`` is ``<durable>/gen-<n>/``: an ordinary ucp_dcp checkpoint folder
(the same data files, sidecar and ``.metadata``), loadable with ``UCPFileSystemReader`` or
``ucp_dcp.load`` by anyone. Each rank copies the files it wrote from its host's memory (fsynced), and
after every rank has, the coordinator commits with the same atomic rename as a direct save: a drain
that dies leaves data files without ``.metadata`` there, which no loader takes for a checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

from ..storage.commit import METADATA, commit
from .replicate import Generation, writer_rank

__all__ = ["durable_dir", "durable_generations", "drain_files", "commit_drain", "prune_durable"]

_GEN = re.compile(r"^gen-(\d+)$")


def durable_dir(durable: str, gen: int) -> str:
    return os.path.join(durable, f"gen-{gen:08d}")


def durable_folders(durable: str | None) -> list[int]:
    """Generations with a durable folder, committed or not (a drain that died leaves one), ascending."""
    if not durable:
        return []
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


def drain_files(g: Generation, durable: str) -> None:
    """Copy the data files this rank wrote from host memory to the durable folder, fsynced."""
    me = dist.get_rank()
    src = g.folder(g.hosts.host_of(me))
    dst = durable_dir(durable, g.gen)
    os.makedirs(dst, exist_ok=True)
    for name in sorted(g.files):
        if writer_rank(name, g.hosts) != me:
            continue
        tmp = os.path.join(dst, f"{name}.drain")
        shutil.copyfile(os.path.join(src, name), tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(dst, name))


def commit_drain(g: Generation, durable: str, group: dist.ProcessGroup, keep: int) -> None:
    """After every rank copied its files: the coordinator commits the durable copy, then drops durable
    generations beyond the newest ``keep`` and the leftovers of drains that died (:func:`prune_durable`)."""
    dist.barrier(group=group)
    if dist.get_rank() != g.hosts.ranks[0]:
        return
    commit(durable_dir(durable, g.gen), g.md, g.sidecar, set(g.files), sync=True)
    prune_durable(durable, g.gen, keep)
