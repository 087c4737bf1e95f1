"""torchtitan's ``step-N`` checkpoint folders, found and purged by what is committed in them, on a local
folder or an object store (``--checkpoint.folder s3://bucket/run``).

torchtitan 0.3 finds the step to resume from with one listing plus ``isfile`` probes through fsspec, whose
answers on an object store may come from a cached listing taken before the last save; and its
``keep_latest_k`` purge counts every ``step-N`` name, committed or not, then deletes the folders in one
recursive delete whose order the store chooses. A purge that dies half-way can leave a ``.metadata``
naming objects already gone, and an async save still uploading counts as one of the ``k`` kept, so the
last committed checkpoint can be deleted before its successor commits.

:class:`StepFolders` instead:

* finds the latest step whose ``.metadata`` (or Hugging Face index) exists, asked by name, one ``HEAD``
  per step on a store, never from a cached listing (the listing only names the candidate steps);
* keeps the ``k`` newest *committed* steps: a newer folder without ``.metadata`` (a save in flight) is kept
  and does not count; an older one (a save that died) is purged;
* purges a step by first deleting its commit point (``.metadata``, the HF index): from then on the folder
  is not a checkpoint, whatever the rest of the delete does or does not get to.
"""

from __future__ import annotations

import os
import re

from ..storage.commit import METADATA
from ..storage.object_store import OBJECT_PROTOCOLS, ObjectStore, object_protocol

__all__ = ["COMMIT_POINTS", "StepFolders", "step_folders"]

STEP = re.compile(r"step-(\d+)")
"""torchtitan's step folder names (searched, as torchtitan does)."""
COMMIT_POINTS = (METADATA, "model.safetensors.index.json")
"""The object whose presence makes a step folder a checkpoint: DCP's ``.metadata``, or the index of a
Hugging Face export (``last_save_in_hf``)."""


class StepFolders:
    """The ``step-N`` folders under one checkpoint folder (a local path or an object-store URL)."""

    def __init__(self, folder: str) -> None:
        self.folder = str(folder).rstrip("/") or str(folder)
        self.store = ObjectStore(self.folder) if object_protocol(self.folder) in OBJECT_PROTOCOLS else None
        """The store holding the folders (None: a local folder)."""

    def join(self, *names: str) -> str:
        return "/".join([self.folder, *names]) if self.store is not None else os.path.join(self.folder, *names)

    def forget_listings(self) -> None:
        """Drop the fsspec client's cached listings (torchtitan's own checks reuse the same client)."""
        if self.store is not None:
            self.store.fs.invalidate_cache()

    def steps(self) -> dict[int, str]:
        """Step -> folder name, from a listing (it may miss a folder written a moment ago)."""
        if self.store is not None:
            names = self.store.names() or []
        else:
            names = os.listdir(self.folder) if os.path.isdir(self.folder) else []
        out: dict[int, str] = {}
        for name in names:
            m = STEP.search(name)
            if m:
                out[int(m.group(1))] = name
        return out

    def committed(self, name: str) -> bool:
        """Does step folder ``name`` hold a commit point (asked by name: one HEAD each on a store)?"""
        for point in COMMIT_POINTS:
            path = self.join(name, point)
            if self.store.size(path) is not None if self.store is not None else os.path.isfile(path):
                return True
        return False

    def latest(self) -> int:
        """The newest committed step, -1 when there is none."""
        for step, name in sorted(self.steps().items(), reverse=True):
            if self.committed(name):
                return step
        return -1

    def stale(self, keep: int) -> list[str]:
        """Folders to purge keeping the ``keep`` newest committed steps: committed ones older than those,
        and uncommitted ones (saves that died) older than the newest committed kept. Oldest first."""
        steps = sorted(self.steps().items(), reverse=True)
        kept, out = 0, []
        for _, name in steps:
            done = self.committed(name)
            if kept >= keep or (kept and not done):
                out.append(name)
            elif done:
                kept += 1
        return out[::-1]

    def decommit(self, name: str) -> None:
        """Delete the commit point of step folder ``name``: it stops being a checkpoint at once."""
        for point in COMMIT_POINTS:
            path = self.join(name, point)
            if self.store is not None:
                self.store.remove(path)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass


def step_folders(folder: str) -> StepFolders | None:
    """The folders of ``folder``, None for a protocol ucp_dcp does not write to (left to torchtitan)."""
    proto = object_protocol(folder)
    if proto is not None and proto not in OBJECT_PROTOCOLS:
        return None
    return StepFolders(folder)
