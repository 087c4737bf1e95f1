"""``ucp_dcp.memory.load``: restart from the freshest complete tier, at any layout."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import ucp_errors
from ..planning.load_planner import UCPLoadPlanner
from ..storage.reader import UCPFileSystemReader
from .locate import Source, locate
from .reader import MemoryReader
from .store import default_root

__all__ = ["load"]


def load(
    state_dict: dict,
    root: str | os.PathLike | None = None,
    *,
    durable: str | os.PathLike | None = None,
    planner: Any = None,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> Source:
    """Load ``state_dict`` in place (collective) from the freshest complete generation: the memory tier
    when every piece of it is intact on some host of this job (each rank reads what its host holds and
    gets the rest from peers), else the durable copy under ``durable``, with the same checks. Raises
    :class:`~ucp_dcp.errors.CheckpointNotFoundError` when neither holds a complete generation.

    ``verify``: hash every memory data file against its completion marker first (a damaged replica is
    then passed over for an intact copy instead of failing the load). Returns the :class:`Source`
    (tier, generation, what was passed over and why), with the reader's ``stats``."""
    root = str(root) if root is not None else default_root()
    src = locate(root, str(durable) if durable is not None else None, process_group, verify)
    reader = MemoryReader(src, root) if src.tier == "memory" else UCPFileSystemReader(str(src.path))
    with ucp_errors():
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner if planner is not None else UCPLoadPlanner(),
            process_group=process_group,
        )
    src.stats = reader.stats
    return src
