"""``ucp_dcp.save`` / ``ucp_dcp.load``: the protected path in one call.

Each is ``dcp.save`` / ``dcp.load`` with ucp_dcp's planners *and* storage, so a checkpoint gets
block checksums on every byte, an atomic commit and safe opening without the caller wiring four
objects, and failures come out as a plain :class:`UCPError` instead of DCP's wrapper.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

from .errors import UnexpectedArgumentError, ucp_errors
from .planning.control_group import controlled, mark
from .planning.load_planner import UCPLoadPlanner
from .planning.save_planner import UCPSavePlanner
from .storage.reader import ReadStats, UCPFileSystemReader
from .storage.writer import UCPFileSystemWriter

__all__ = ["save", "load"]


def save(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    control_group: bool | None = None,
    checksums: bool = True,
    thread_count: int = 1,
    sync_files: bool = True,
    **planner_options: Any,
) -> None:
    """Save ``state_dict`` (collective) into the folder ``path`` as parallelism-independent atoms.

    A checkpoint already in ``path`` stays loadable until this one commits. ``planner_options``
    go to :class:`UCPSavePlanner` (``patterns``, ``stage_map``, ``check_replicas``, ...).
    ``control_group`` (default ``$UCP_DCP_CONTROL_GROUP``, on): DCP's collectives run through the
    job's store, so a rank that dies ends every other rank with a ``PeerLostError`` within
    ``UCP_DCP_PEER_TIMEOUT_S`` instead of the process group's timeout (``docs/reliability.md``).
    """
    _check_call("save", state_dict, path)
    mark("save", "start")
    writer = UCPFileSystemWriter(path, checksums=checksums, thread_count=thread_count, sync_files=sync_files)
    if checksums:  # replicas are compared from the block checksums the writer computes anyway
        planner_options.setdefault("replica_digests", "writer")
    with ucp_errors(), controlled(process_group, control_group) as group:
        dcp.save(state_dict, storage_writer=writer, planner=UCPSavePlanner(**planner_options), process_group=group)
    mark("save", "done")


def load(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    control_group: bool | None = None,
    trust: bool = False,
    verify_checksums: bool = True,
    thread_count: int | None = None,
    **planner_options: Any,
) -> ReadStats:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective), at any layout.

    Every byte read is verified against the checksums written at save; the checkpoint's metadata
    and values are decoded without running code unless ``trust=True``. ``planner_options`` go to
    :class:`UCPLoadPlanner`. Returns this rank's I/O figures. ``control_group``: as for :func:`save`.
    """
    _check_call("load", state_dict, path)
    mark("load", "start")
    reader = UCPFileSystemReader(path, trust=trust, verify_checksums=verify_checksums, thread_count=thread_count)
    with ucp_errors(), controlled(process_group, control_group) as group:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=UCPLoadPlanner(trust=trust, **planner_options),
            process_group=group,
        )
    mark("load", "done")
    return reader.stats


def _check_call(what: str, state_dict: Any, path: Any) -> None:
    """Refuse, before any collective, arguments DCP would fail on deep inside (an AttributeError)."""
    if not isinstance(state_dict, Mapping):
        raise UnexpectedArgumentError(
            f"ucp_dcp.{what}: state_dict must be a dict (a mapping of keys to tensors and values), got "
            f"{type(state_dict).__name__}",
            wanted="dict",
            saved=type(state_dict).__name__,
        )
    if not isinstance(path, (str, os.PathLike)):
        raise UnexpectedArgumentError(
            f"ucp_dcp.{what}: path must be a folder (str or os.PathLike), got {type(path).__name__}",
            wanted="str | os.PathLike",
            saved=type(path).__name__,
        )
