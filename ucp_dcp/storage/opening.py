"""Opening a checkpoint folder by path (local or fsspec URL): its metadata, checked by
:func:`ucp_dcp.storage.commit.open_checkpoint` (sidecar, commit state, safe unpickling), and the ``step-N``
subfolders of a torchtitan ``checkpoint/`` folder. The one way the tools, the dry run and the torchtitan
integration open a checkpoint they are given by path."""

from __future__ import annotations

import os
import re
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .._compat import fsspec_filesystem
from .commit import METADATA, Integrity, open_checkpoint

__all__ = ["open_path", "read_metadata", "step_folders", "filesystem"]


def filesystem(path: str | os.PathLike) -> tuple[Any, Any]:
    """DCP file system object for a local path or an fsspec URL, and the initialized path."""
    if "://" in str(path):
        fs = fsspec_filesystem()()
        return fs, fs.init_path(str(path))
    from torch.distributed.checkpoint.filesystem import FileSystem

    fs = FileSystem()
    return fs, fs.init_path(path)


def open_path(path: str | os.PathLike, *, trust: bool = False) -> tuple[Metadata, Integrity]:
    """Metadata and integrity status of a checkpoint folder (local path or fsspec URL)."""
    fs, root = filesystem(path)
    return open_checkpoint(fs, root, trust=trust)


def read_metadata(path: str | os.PathLike, *, trust: bool = False) -> Metadata:
    """``Metadata`` of a checkpoint folder, opened safely."""
    return open_path(path, trust=trust)[0]


_STEP = re.compile(r"step-(\d+)")


def step_folders(path: str | os.PathLike) -> list[tuple[int, str]] | None:
    """``(step, folder name)`` of the ``step-N`` subfolders of a torchtitan ``checkpoint/`` folder,
    by step; None when ``path`` is itself a checkpoint (holds ``.metadata``), is missing, or has no
    ``step-N`` subfolder."""
    fs, root = filesystem(path)
    try:
        names = [os.path.basename(str(p).rstrip("/")) for p in fs.ls(root)]
    except OSError:  # missing, not a folder, unreadable: opening it as a checkpoint says which
        return None
    if METADATA in names:
        return None
    steps = sorted((int(m.group(1)), n) for n in names if (m := _STEP.fullmatch(n)))
    return steps or None
