"""What ucp_dcp's planners and storage expect of each other, as typed protocols.

DCP hands a storage layer the planner's ``SavePlan``/``LoadPlan`` (its ``planner_data`` is the planner's own
object) and, for the writes, the planner itself. ucp_dcp's storage does more with a ucp_dcp planner than with
another one; what it needs is named here and checked with ``isinstance``, never looked up by attribute name,
so a planner/storage pair either meets a protocol or is handled as a stock one:

* :class:`WriterAcknowledgement` -- the save plan's ``planner_data`` of a planner that may leave its replica
  comparison to the storage writer (``UCPSavePlanner(replica_digests="writer")``). ``UCPFileSystemWriter``
  answers it in ``prepare_local_plan``; a writer that does not (DCP's ``FileSystemWriter``) leaves the
  payload unmarked, and the coordinator refuses the save naming the pair before anything is written.
* :class:`ReplicaCopySource` -- the save planner, asked by the writer for the copies of replicated pieces
  this rank holds but another rank writes (compared with the written copy before the commit).
* :class:`ReadOnceRequest` -- the load plan's ``planner_data`` of a planner that tells the reader who
  should receive bytes several ranks need, and that it puts its read items back in ``finish_plan``.

Every other pair works as DCP's own: DCP's planners with ucp_dcp's storage, ucp_dcp's planners with DCP's
storage (docs/compatibility.md, "Planner and storage pairs").
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from .payloads import ReadOnceMode

__all__ = ["WriterAcknowledgement", "ReplicaCopySource", "ReadOnceRequest"]


@runtime_checkable
class WriterAcknowledgement(Protocol):
    """``SavePlan.planner_data`` that the storage writer marks in ``prepare_local_plan``."""

    def acknowledge_writer(self, writer: str, compares_replicas: bool) -> Any:
        """This payload, marked with the writer's class name and whether it compares the replicated pieces
        this rank holds with the written copy (it will call :meth:`ReplicaCopySource.replica_copies`)."""
        ...


@runtime_checkable
class ReplicaCopySource(Protocol):
    """A save planner that hands the writer this rank's copies of pieces another rank writes."""

    def replica_copies(self) -> list[tuple[MetadataIndex, torch.Tensor]]:
        """``(index of the written piece, this rank's copy)`` per piece to compare (after ``finish_plan``)."""
        ...


@runtime_checkable
class ReadOnceRequest(Protocol):
    """``LoadPlan.planner_data`` of a load planner that talks to the reader about its reads."""

    read_once: ReadOnceMode
    """Who receives saved bytes several ranks need: the planner's wish; a reader given its own keeps it."""
    keeps_items: bool
    """The planner puts its read items back in ``finish_plan``: the reader may leave them out of the
    gathered plan (and refuses a final plan that lacks them)."""
