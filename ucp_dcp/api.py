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
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, TensorStorageMetadata

from ._compat import group_has_cpu_backend
from .errors import InvalidArgumentError, UnexpectedArgumentError, ucp_error_of, ucp_errors, user_frames
from .planning.checkpoint_group import guarded
from .planning.load_planner import UCPLoadPlanner
from .planning.plan_cache import PlanCacheMissError
from .planning.save_planner import UCPSavePlanner
from .progress import CallProgress, size_text
from .storage.reader import ReadStats, UCPFileSystemReader
from .storage.writer import UCPFileSystemWriter

__all__ = ["save", "async_save", "load", "SavedMetadata"]


@user_frames
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
    with ucp_errors(), CallProgress("save") as writer.progress, guarded(process_group, control_group, "save") as group:
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
    commit and is the checkpoint's ``Metadata`` (a :class:`SavedMetadata`: its ``repr`` is one line), or, with
    an ``async_stager`` that stages asynchronously (DCP's ``DefaultStager`` with
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
    # DCP's checkpoint process gets a pickled writer, without this progress: its writing shows from there
    progress = CallProgress("async save", "staging") if kind != AsyncCheckpointerType.PROCESS else None
    writer.progress = progress
    if progress is not None:
        progress.__enter__()
    try:
        with ucp_errors():
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                planner=UCPSavePlanner(**planner_options),
                process_group=process_group,
                async_checkpointer_type=kind,
                **extra,
            )
    except BaseException:  # re-raised: only the progress line is closed as failed
        if progress is not None:
            progress.close(failed=True)
        raise
    if isinstance(ret, Future):
        return _plain_errors(ret, progress)
    ret.upload_completion = _plain_errors(ret.upload_completion, progress)  # AsyncSaveResponse (a dataclass)
    return ret


def _plain_errors(fut: Future, progress: CallProgress | None = None) -> Future:
    """A future with ``fut``'s result (a checkpoint's metadata as a :class:`SavedMetadata`), whose failure is the
    ``UCPError`` inside DCP's wrapper; ``progress`` ends with it."""
    out: Future = Future()

    def done(f: Future) -> None:
        exc = f.exception()
        if progress is not None:
            progress.close(failed=exc is not None)
        if exc is None:
            result = f.result()
            out.set_result(SavedMetadata.of(result) if type(result) is Metadata else result)
        else:
            out.set_exception(ucp_error_of(exc))

    fut.add_done_callback(done)
    return out


class SavedMetadata(Metadata):
    """DCP's ``Metadata`` of a checkpoint ``async_save`` committed, the same fields (the same objects), with a
    one-line ``repr``: printing DCP's own lists every chunk of every key (about 300 KB for 10,000 tensors).

    It is a ``Metadata`` (``isinstance`` holds, DCP and its planners take it as one), compares equal to a plain
    ``Metadata`` with equal fields, and pickles as a plain ``Metadata``: a ``.metadata`` written from it, or a copy
    sent to a process without ucp_dcp, is DCP's own type."""

    @classmethod
    def of(cls, md: Metadata) -> SavedMetadata:
        out = cls.__new__(cls)
        out.__dict__.update(md.__dict__)  # every field, whatever this torch's Metadata has
        return out

    def __repr__(self) -> str:
        sdm = self.state_dict_metadata or {}
        tensors = [m for m in sdm.values() if isinstance(m, TensorStorageMetadata)]
        nbytes = sum(_numel(m.size) * m.properties.dtype.itemsize for m in tensors if m.properties.dtype is not None)
        chunks = sum(len(m.chunks) for m in tensors)
        cid = getattr(self.storage_meta, "checkpoint_id", None)
        where = f", checkpoint_id={str(cid)!r}" if cid else ""
        return (
            f"SavedMetadata({len(sdm)} key(s): {len(tensors)} tensor(s) of {size_text(nbytes)} in {chunks} chunk(s), "
            f"{len(sdm) - len(tensors)} object(s); version {self.version}{where})"
        )

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Metadata):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # as DCP's (an unfrozen dataclass)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # unpickles as DCP's own class: Metadata(None), then these fields (no ucp_dcp needed where it is read)
        return (Metadata, (None,), dict(self.__dict__))


def _numel(size: Any) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


@user_frames
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

    def once(cache: bool, progress: CallProgress) -> ReadStats:
        reader = UCPFileSystemReader(path, trust=trust, verify_checksums=verify_checksums, thread_count=thread_count)
        reader.progress = progress
        planner = UCPLoadPlanner(trust=trust, cache_plans=cache, **planner_options)
        with ucp_errors(), guarded(process_group, control_group, "load") as group:
            dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group)
        return reader.stats

    with CallProgress("load") as progress:
        try:
            return once(cache_plans, progress)
        except PlanCacheMissError:  # raised on every rank, before anything was read: plan afresh
            if not cache_plans:
                raise
            return once(False, progress)


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
