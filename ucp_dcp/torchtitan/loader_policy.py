"""``dataloader_policy``: a saved dataloader state that cannot fill this run's loader, refused or restarted.

torchtitan's text loader keeps per-rank state (``dataloader.dp_rank_<r>``) that means nothing at another
data-parallel degree; the global-cursor loader keeps one global state. Before ``dcp.load`` reads anything,
the manager compares the checkpoint's dataloader keys with what this run's loader wants: a mismatch is a
:class:`~ucp_dcp.errors.UCPError` (``"error"``), or the loader is left out of the load and every rank
restarts its data stream (``"restart"``) -- never a silent wrong position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from torch.distributed.checkpoint.metadata import Metadata
from torchtitan.components.checkpointer.base import DATALOADER

from ..errors import UCPError

__all__ = ["DataloaderPolicy", "apply_dataloader_policy"]

logger = logging.getLogger("ucp_dcp.torchtitan.manager")  # the manager's messages, under its name

DataloaderPolicy = Literal["error", "restart"]
"""``dataloader_policy``: refuse a dataloader state that cannot be remapped, or restart the data streams."""


def apply_dataloader_policy(
    state_dict: dict[str, Any], metadata: Callable[[], Metadata], policy: DataloaderPolicy
) -> dict[str, Any]:
    """Check, before anything is read, that the saved dataloader state fits this run's loader: ``state_dict``
    as it is, without its dataloader (``policy`` ``"restart"``), or a :class:`UCPError` (``"error"``).
    ``metadata`` opens the checkpoint's metadata (called only when there is a loader state to check; the
    manager hands in the opening its ``dcp.load`` then reuses)."""
    loader = state_dict.get(DATALOADER)
    if loader is None:
        return state_dict
    target = loader.state_dict() if hasattr(loader, "state_dict") else loader  # DCP loads Stateful objects
    if not isinstance(target, dict) or not target:  # nothing to load (a loader without state), as stock
        return state_dict
    saved = {k[len(DATALOADER) + 1 :] for k in metadata().state_dict_metadata if k.startswith(DATALOADER + ".")}
    problem = _dataloader_mismatch(saved, set(target), target.get("world_size"))
    if problem is None:
        return state_dict
    if policy == "restart":
        logger.warning(
            "UCP: %s; dataloader_policy='restart': every rank restarts its data stream from the "
            "beginning (deterministically), the rest of the state is loaded",
            problem,
        )
        return {k: v for k, v in state_dict.items() if k != DATALOADER}
    raise UCPError(
        f"{problem}; refusing to resume at an undefined data position",
        atom=DATALOADER,
        saved=sorted(saved)[:6],
        wanted=sorted(target)[:6],
        hint="use ucp_dcp's GlobalCursorTextDataLoader (resumes at any DP degree), set "
        "checkpoint.dataloader_policy='restart', or exclude_from_loading=['dataloader']",
    )


def _dataloader_mismatch(saved: set[str], target: set[str], world: int | None) -> str | None:
    """Why the saved dataloader keys cannot fill the target loader (None if they can)."""
    per_rank = lambda keys: sorted(k for k in keys if k.startswith("dp_rank_"))  # noqa: E731
    if not saved:
        return "the checkpoint holds no dataloader state"
    if per_rank(target):
        if not per_rank(saved):
            return "the checkpoint holds a global-cursor dataloader state but this run uses a per-rank loader"
        if len(per_rank(saved)) != world or not set(per_rank(target)) <= saved:
            return (
                f"the per-rank dataloader state was saved at data-parallel degree {len(per_rank(saved))} "
                f"and cannot be remapped to data-parallel degree {world}"
            )
        return None
    missing = target - saved
    if missing:
        kind = "per-rank" if per_rank(saved) else "another"
        return f"the checkpoint holds {kind} dataloader state ({', '.join(sorted(saved)[:3])}), not {sorted(missing)}"
    return None
