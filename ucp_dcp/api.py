"""``ucp_dcp.save`` / ``ucp_dcp.async_save`` / ``ucp_dcp.load``: the protected path in one call.

Each is ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with ucp_dcp's planners *and* storage, so a checkpoint gets
block checksums on every byte, an atomic commit and safe opening without the caller wiring four
objects, and failures come out as a plain :class:`UCPError` instead of DCP's wrapper.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

from ._compat import group_has_cpu_backend
from .errors import InvalidArgumentError, UnexpectedArgumentError, ucp_error_of, ucp_errors
from .planning.checkpoint_group import guarded
from .planning.load_planner import UCPLoadPlanner
from .planning.plan_cache import PlanCacheMissError
from .planning.save_planner import UCPSavePlanner
from .storage.reader import ReadStats, UCPFileSystemReader
from .storage.writer import UCPFileSystemWriter

__all__ = ["save", "async_save", "load"]


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
    ``control_group`` (default ``$UCP_DCP_CONTROL_GROUP``, on): DCP's collectives run on ucp_dcp's
    checkpoint group (gloo, each collective behind a gate of a few store keys), so a rank that dies or
    freezes ends every other rank with a ``PeerLostError`` within about ``UCP_DCP_PEER_TIMEOUT_S``
    instead of the process group's timeout (``docs/reliability.md``).
    """
    _check_call("save", state_dict, path)
    writer = UCPFileSystemWriter(path, checksums=checksums, thread_count=thread_count, sync_files=sync_files)
    if checksums:  # replicas are compared from the block checksums the writer computes anyway
        planner_options.setdefault("replica_digests", "writer")
    with ucp_errors(), guarded(process_group, control_group, "save") as group:
        dcp.save(state_dict, storage_writer=writer, planner=UCPSavePlanner(**planner_options), process_group=group)


def async_save(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    async_checkpointer_type: Literal["thread", "process"] | Any = "thread",
    async_stager: Any = None,
    checksums: bool = True,
    thread_count: int = 1,
    sync_files: bool = True,
    **planner_options: Any,
) -> Any:
    """:func:`save`, asynchronously, with ``dcp.async_save``'s semantics (collective).

    Returns what ``dcp.async_save`` returns: a ``Future`` whose ``result()`` waits for the write and
    commit, or, with an ``async_stager`` that stages asynchronously (DCP's ``DefaultStager`` with
    ``use_async_staging=True``), an ``AsyncSaveResponse`` whose ``staging_completion`` says when the
    state may change again and ``upload_completion`` when the checkpoint is committed. A failure comes
    out of ``result()`` as the ``UCPError`` itself, not DCP's ``CheckpointException``.

    ``async_checkpointer_type``: ``"thread"`` (a background thread of this process) or ``"process"``
    (DCP's checkpoint process; pinned or shared-memory staging pair with it), or DCP's
    ``AsyncCheckpointerType``. The save's collectives run in the background: give it a
    ``process_group`` of its own with a CPU backend (gloo), as torchtitan does, so they do not
    interleave with training's. ``async_stager`` is passed to DCP and stays the caller's to close.
    """
    _check_call("async_save", state_dict, path)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = async_checkpointer_type
    if isinstance(kind, str):
        if kind not in ("thread", "process"):
            raise InvalidArgumentError(
                f"ucp_dcp.async_save: async_checkpointer_type={kind!r}; expected 'thread' or 'process'",
                saved=kind,
                wanted="thread | process",
            )
        kind = AsyncCheckpointerType(kind)
    if dist.is_available() and dist.is_initialized() and not group_has_cpu_backend(process_group):
        raise InvalidArgumentError(
            "ucp_dcp.async_save: its process group has no CPU backend; the background save copies and "
            "exchanges host memory",
            hint="pass process_group=dist.new_group(backend='gloo') (once, after init_process_group), or "
            "init_process_group('cpu:gloo,cuda:nccl')",
        )
    writer = UCPFileSystemWriter(path, checksums=checksums, thread_count=thread_count, sync_files=sync_files)
    if checksums:
        planner_options.setdefault("replica_digests", "writer")
    extra = {"async_stager": async_stager} if async_stager is not None else {}
    with ucp_errors():
        ret = dcp.async_save(
            state_dict,
            storage_writer=writer,
            planner=UCPSavePlanner(**planner_options),
            process_group=process_group,
            async_checkpointer_type=kind,
            **extra,
        )
    if isinstance(ret, Future):
        return _plain_errors(ret)
    ret.upload_completion = _plain_errors(ret.upload_completion)  # AsyncSaveResponse (a dataclass)
    return ret


def _plain_errors(fut: Future) -> Future:
    """A future with ``fut``'s result, whose failure is the ``UCPError`` inside DCP's wrapper."""
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            out.set_result(f.result())
        else:
            out.set_exception(ucp_error_of(exc))

    fut.add_done_callback(done)
    return out


def load(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    control_group: bool | None = None,
    trust: bool = False,
    verify_checksums: bool = True,
    thread_count: int | None = None,
    cache_plans: bool = True,
    **planner_options: Any,
) -> ReadStats:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective), at any layout.

    Every byte read is verified against the checksums written at save; the checkpoint's metadata
    and values are decoded without running code unless ``trust=True``. ``planner_options`` go to
    :class:`UCPLoadPlanner`. Returns this rank's I/O figures. ``control_group``: as for :func:`save`.
    ``cache_plans`` (default on): a load of the same checkpoint into the same layout as an earlier one of
    this process reuses its plans (``UCPLoadPlanner(cache_plans=...)``; ``stats.plan_cached`` says so).
    """
    _check_call("load", state_dict, path)

    def once(cache: bool) -> ReadStats:
        reader = UCPFileSystemReader(path, trust=trust, verify_checksums=verify_checksums, thread_count=thread_count)
        planner = UCPLoadPlanner(trust=trust, cache_plans=cache, **planner_options)
        with ucp_errors(), guarded(process_group, control_group, "load") as group:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group)
        return reader.stats

    try:
        return once(cache_plans)
    except PlanCacheMissError:  # raised on every rank, before anything was read: plan afresh
        if not cache_plans:
            raise
        return once(False)


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
