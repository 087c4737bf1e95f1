"""torchtitan's own ``dcp_save``/``dcp_load``, given ucp_dcp's planners and storage for one call.

torchtitan's checkpointer calls ``dcp.save``/``dcp.async_save``/``dcp.load`` through the ``dcp`` name of
its module; :func:`dcp_planners` puts a stand-in there for the length of one call, which adds the UCP
planner and, for a local ``checkpoint_id`` that came without one, the UCP storage writer or reader
(checksums, atomic commit, safe opening). Everything else is the real module, so every stock feature of
those calls (async modes, staging, process groups) is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torchtitan.components.checkpointer.dcp as tt_dcp

from ..storage.reader import UCPFileSystemReader
from ..storage.writer import UCPFileSystemWriter

__all__ = ["dcp_planners"]


def _with_storage(kwargs: dict[str, Any], key: str, cls: type) -> dict[str, Any]:
    """Our storage for a local ``checkpoint_id`` that came without one: checksums, atomic commit,
    safe opening (torchtitan passes ``storage_writer=None`` unless it writes Hugging Face files)."""
    cid = kwargs.get("checkpoint_id")
    if kwargs.get(key) is None and cid is not None and "://" not in str(cid):
        kwargs[key] = cls(cid)
    return kwargs


class _PlannerDCP:
    """Stands in for the ``dcp`` module inside torchtitan's checkpointer for one call, adding our
    planner and storage to ``save``/``async_save``/``load``; everything else is the real module."""

    def __init__(self, real: Any, save: Any, load: Any) -> None:
        self._real, self._save, self._load = real, save, load

    def save(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._save())
        return self._real.save(*args, **_with_storage(kwargs, "storage_writer", UCPFileSystemWriter))

    def async_save(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._save())
        return self._real.async_save(*args, **_with_storage(kwargs, "storage_writer", UCPFileSystemWriter))

    def load(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("planner", self._load())
        return self._real.load(*args, **_with_storage(kwargs, "storage_reader", UCPFileSystemReader))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def dcp_planners(save: Any = None, load: Any = None) -> Iterator[None]:
    """Within: torchtitan's checkpointer reaches ``dcp`` through :class:`_PlannerDCP`; ``save`` / ``load``
    make the planner of each DCP call (None: DCP's default)."""
    real = tt_dcp.dcp
    tt_dcp.dcp = _PlannerDCP(real, save or (lambda: None), load or (lambda: None))
    try:
        yield
    finally:
        tt_dcp.dcp = real
