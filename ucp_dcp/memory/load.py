"""``ucp_dcp.memory.load``: restart from the freshest complete tier, at any layout.

The source is chosen from the completion markers and the files' sizes (no pass over the bytes); the
load's block checksums then verify every byte it uses. A memory copy found damaged mid-load (a block
checksum that does not match, a file gone or cut short) does not fail the restart: every host hashes
what it holds against the marker, the damaged copies are passed over, and the load starts again from
the next complete source (another host's copy, else the durable generation), with the reason kept in
:attr:`Source.notes`.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UCPError, ucp_errors
from ..planning.checkpoint_group import dcp_group, guarded
from ..planning.load_planner import UCPLoadPlanner
from ..planning.plan_cache import PlanCacheMissError
from ..storage.reader import UCPFileSystemReader
from ..storage.sidecar import decode_sidecar, metadata_hash, sidecar_name
from .locate import Source, locate
from .reader import MemoryReader
from .store import default_root

__all__ = ["load"]

DAMAGE = (CorruptCheckpointError, IncompleteCheckpointError)
"""A memory copy's bytes are not what its writer saved (a peer's such error is an instance too)."""


def load(
    state_dict: dict,
    root: str | os.PathLike | None = None,
    *,
    durable: str | os.PathLike | None = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = False,
    source: Source | None = None,
    control_group: bool | None = None,
    cache_plans: bool = True,
) -> Source:
    """Load ``state_dict`` in place (collective) from the freshest complete generation: the memory tier
    when every piece of it is on some host of this job (each rank reads what its host holds and gets the
    rest from peers), else the durable copy under ``durable``, with the same checks. Raises
    :class:`~ucp_dcp.errors.CheckpointNotFoundError` when neither holds a complete generation.

    Every byte loaded is verified by the block checksums; a memory copy found damaged during the load
    is passed over and the load retried from the next complete source. ``verify``: hash every memory
    data file against its completion marker before choosing (slower: a pass over every byte held; the
    choice then never meets a damaged copy). ``source``: what :func:`~ucp_dcp.memory.locate.locate` chose
    just before, with the same arguments (a caller that looked first does not locate twice). Returns the
    :class:`Source` (tier, generation, what was passed over and why), with the reader's ``stats``.
    ``control_group``: the collectives (the choice, DCP's) on the checkpoint group, so a rank that dies ends
    every other rank within about ``UCP_DCP_PEER_TIMEOUT_S`` (None: ``$UCP_DCP_CONTROL_GROUP``, on).
    ``cache_plans`` (default on, as for :func:`ucp_dcp.load`): the default planner reuses this process's
    plans for a generation it loaded before into the same layout (an in-process restart, an evaluation
    sweep); ``stats.plan_cached`` says so. A ``planner`` given keeps its own ``cache_plans``."""
    group = dcp_group(process_group, control_group)
    root = str(root) if root is not None else default_root()
    disk = str(durable) if durable is not None else None
    src = source if source is not None else locate(root, disk, group, verify)
    if src.tier == "memory" and not verify and not _block_checksums(src):
        verify = True  # nothing would catch a damaged byte during the read: hash the files first
        src = locate(root, disk, group, True)
    the_planner = planner if planner is not None else UCPLoadPlanner(cache_plans=cache_plans)
    while src.tier == "memory":
        try:
            src.stats = _load(state_dict, MemoryReader(src, root), the_planner, group)
            return src
        except DAMAGE as e:
            if verify:  # the files hashed intact, yet a read failed: nothing better to choose
                raise
            why = e.message.splitlines()[0]
        # every rank got a damage error (DCP gathers the read's failures; a peer's is an instance of
        # its cause's class): all of them choose again, this time from hashed copies
        verify = True
        failed = src.generation
        src = locate(root, disk, group, True)
        src.notes.insert(0, f"gen {failed} (memory): a copy was found damaged during the load ({why}); retried")
    assert src.path is not None
    src.stats = _load(state_dict, UCPFileSystemReader(src.path), the_planner, group)
    return src


def _load(state_dict: dict, reader: Any, planner: Any, group: dist.ProcessGroup | None) -> Any:
    try:
        _dcp_load(state_dict, reader, planner, group)
    except PlanCacheMissError:
        # raised on every rank before anything was read (the coordinator lacks a key this rank sent, e.g. it
        # restarted): the load changed nothing, so it plans afresh once, as ucp_dcp.load does
        planner.cache_plans, was = False, planner.cache_plans
        try:
            _dcp_load(state_dict, reader, planner, group)
        finally:
            planner.cache_plans = was
    if isinstance(reader, MemoryReader):  # its reads skip the file reader's keyed answers, which set this
        reader.stats.plan_cached = bool(getattr(planner, "plan_cache_hit", False))
    return reader.stats


def _dcp_load(state_dict: dict, reader: Any, planner: Any, group: dist.ProcessGroup | None) -> None:
    with ucp_errors(), guarded(group, None, "memory load") as pg:
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=pg)


def _block_checksums(src: Source) -> bool:
    """Does the generation's sidecar record block checksums for its data (the writer's default)?"""
    try:
        body = decode_sidecar(src.sidecar, sidecar_name(metadata_hash(src.md)))
    except UCPError:
        return False  # the reader refuses it with the reason
    return bool((body.get("io") or {}).get("algo"))
