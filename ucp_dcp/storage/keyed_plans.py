"""The reader's side of the load-plan cache (``cache_plans=True``, :mod:`ucp_dcp.planning.plan_cache`): its wire
types, what this process keeps, and the steps :class:`~ucp_dcp.storage.reader.UCPFileSystemReader` takes.

A load planner whose plan is cached (``UCPLoadPlanner(cache_plans=True)``) puts its plan key in
``planner_data``; the reader then keys its read-once summary (:func:`keyed_summary`, :class:`KeyedSummary`):
the key alone when this process sent the summary to a coordinator in an earlier, finished load. The
coordinator keeps summaries and its read-once answers by key (:func:`keyed_answers`); it answers a rank that
holds the very answer with a marker (:class:`KeyedTransport` without a plan), which ``read_data`` resolves
from this process's cache (:func:`resolved_answer`).

The caches are :class:`~ucp_dcp.planning.plan_cache.ProcessCache` s, so ``plan_cache.clear()`` empties them
with the planner's; the counters and the markers of unfinished loads are the plan cache's too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from ..errors import UCPError
from ..planning import plan_cache
from ..planning.load_cache import plan_key_of
from ..planning.payloads import Compact, ReadOnceMode
from ..planning.plan_cache import ENTRIES, CachedLoadPlan, PlanCacheMissError, ProcessCache
from .read_job import ReadStats
from .transport import ReadSummary, TransportPlan, local_summary

__all__ = [
    "KeyedSummary",
    "KeyedTransport",
    "ReaderEntry",
    "Pending",
    "keyed_summary",
    "keyed_answers",
    "summaries",
    "cached_summary",
    "resolved_answer",
]


# -- wire types --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyedSummary(Compact):
    """A loading rank's ``LoadPlan.storage_data`` when plans are cached: its read-once summary and the key
    it is cached under, or only the key (the coordinator holds the summary)."""

    key: bytes
    """The reader's key: the plan key, the read-once mode, the global rank and the host."""
    summary: ReadSummary | None = None
    """The summary; None: the coordinator's cached one for ``key``."""
    last: bytes | None = None
    """The global key of the answer this rank holds for ``key`` (the coordinator then answers with a marker)."""


@dataclass(frozen=True)
class KeyedTransport(Compact):
    """The coordinator's read-once answer to a rank that sent a :class:`KeyedSummary`."""

    key: bytes | None
    """The global key (of every rank's reader key, in plan order); None when some rank's plan was not keyed."""
    plan: TransportPlan | None = None
    """The answer; None: the one the rank holds for ``key`` (its ``KeyedSummary.last``)."""


# -- what each side keeps ----------------------------------------------------------------------------------------


@dataclass
class ReaderEntry:
    """A rank's read-once side: the coordinator's last answer for this reader key."""

    answer_key: bytes | None
    """Its global key (None: the answer was not keyed)."""
    transport: TransportPlan | None
    """The answer."""


@dataclass(frozen=True)
class Pending:
    """A load whose summary was keyed, from ``prepare_local_plan`` until the coordinator's answer arrives."""

    key: bytes
    """The reader key."""
    entry: ReaderEntry | None
    """What this process holds under it (None: nothing, the summary went whole)."""
    plan_cached: bool
    """The planner's plan was cached too (its ``planner_data`` is a marker)."""


_READER: ProcessCache[ReaderEntry] = ProcessCache()
"""A rank's side: reader key -> the coordinator's last answer."""
_SUMMARIES: ProcessCache[ReadSummary] = ProcessCache()
"""The coordinator's: reader key -> the summary a rank sent under it."""
_TRANSPORTS: ProcessCache[list[TransportPlan]] = ProcessCache()
"""The coordinator's: global key (every rank's reader key) -> its answers, in plan order."""


# -- prepare_local_plan: a rank's summary ------------------------------------------------------------------------


def keyed_summary(
    plan: LoadPlan, md: Metadata, mode: ReadOnceMode, reader: type
) -> tuple[ReadSummary | KeyedSummary, Pending | None]:
    """This rank's read-once summary, and what the load keeps for its answer; a planner's cached plan (its
    key in ``planner_data``) gets a keyed one: only the key when this process sent its summary to a
    coordinator before. ``reader``: the reader's class (part of the key)."""
    plan_key = plan_key_of(plan.planner_data)
    if plan_key is None:  # another planner, or a plan not cached: the summary as DCP's gather carries it
        return local_summary(plan.items, md, mode), None
    key = plan_cache.reader_key(plan_key, reader, mode)
    # after a load of this process that failed before its answer, the coordinator may lack what it sent:
    # send the summary whole once (begin says so)
    entry = _READER.use(key) if plan_cache.begin("reader") else None
    pending = Pending(key, entry, isinstance(plan.planner_data, CachedLoadPlan))
    plan_cache.count("reader_hit" if entry is not None else "reader_miss")
    if entry is not None:
        return KeyedSummary(key, None, entry.answer_key), pending
    return KeyedSummary(key, local_summary(plan.items, md, mode)), pending


# -- prepare_global_plan: the coordinator's answers --------------------------------------------------------------


def keyed_answers(
    plans: list[LoadPlan], plan_transport: Callable[[list[ReadSummary | None]], list[TransportPlan]]
) -> list[LoadPlan]:
    """The coordinator's read-once answers (``plan_transport`` of every rank's summary): for the same reader
    keys on every rank the cached ones, and a marker for a rank that holds its own."""
    keyed = [p.storage_data if isinstance(p.storage_data, KeyedSummary) else None for p in plans]
    keys = [k.key for k in keyed if k is not None]
    # the answers depend on every rank's summary: keyed only when every rank's is
    gkey = plan_cache.digest(b"ucp-load-transport-1", *keys) if len(keys) == len(plans) else None
    transports = None
    if gkey is not None:
        transports = _TRANSPORTS.use(gkey)
        plan_cache.count("transport_reused" if transports is not None else "transport_planned")
    if transports is None:
        transports = plan_transport(summaries(plans))
        if gkey is not None:
            _TRANSPORTS.keep(gkey, transports, ENTRIES)
    else:  # not read, but used: kept as recent as the answers they gave
        for key in keys:
            _SUMMARIES.use(key)
    out = []
    for p, k, t in zip(plans, keyed, transports):
        answer: Any = t
        if k is not None:  # a rank that holds this very answer gets a marker of it
            answer = KeyedTransport(gkey, None if gkey is not None and k.last == gkey else t)
        out.append(dataclasses.replace(p, storage_data=answer))
    return out


def summaries(plans: list[LoadPlan]) -> list[ReadSummary | None]:
    """Every rank's summary: a keyed one's from the cache, where the coordinator keeps the others (None: a
    rank whose reader sent none, another reader's plan)."""
    out: list[ReadSummary | None] = []
    for rank, p in enumerate(plans):
        sd = p.storage_data
        if isinstance(sd, KeyedSummary):
            if sd.summary is None:
                sd = cached_summary(sd.key, rank)
            else:
                _SUMMARIES.keep(sd.key, sd.summary, plan_cache.coordinator_entries(len(plans)))
                sd = sd.summary
        out.append(sd if isinstance(sd, ReadSummary) else None)
    return out


def cached_summary(key: bytes, rank: int) -> ReadSummary:
    """The summary rank ``rank`` sent under ``key`` in an earlier load (:class:`PlanCacheMissError`: not held)."""
    found = _SUMMARIES.use(key)
    if found is None:
        raise PlanCacheMissError.of_marker(rank, "read-once summary")
    return found


# -- read_data: the answer resolved --------------------------------------------------------------------------


def resolved_answer(plan: LoadPlan, pending: Pending | None, stats: ReadStats, reader: str) -> LoadPlan:
    """The plan with the coordinator's read-once answer: a keyed one resolved (a marker: the answer this
    rank holds) and cached for the next load; ``stats`` told whether the plans were cached. ``pending``: what
    :func:`keyed_summary` kept for this load; ``reader``: the reader's class name (for the error)."""
    answer = plan.storage_data
    if not isinstance(answer, KeyedTransport):
        return plan
    if pending is None:
        raise UCPError(
            f"{reader}.read_data was given a keyed read-once answer for a plan this reader did "
            "not key in prepare_local_plan",
            hint="let dcp.load drive the reader: prepare_local_plan, the coordinator's prepare_global_plan, "
            "then read_data with the plan it answered",
        )
    transport = answer.plan
    if transport is None:
        if pending.entry is None or pending.entry.answer_key != answer.key:
            raise UCPError(
                "the coordinator answered this rank with its cached read-once plan, which this process does not hold",
                hint="load again with cache_plans=False, or call ucp_dcp.planning.plan_cache.clear() on every rank",
            )
        transport = pending.entry.transport
    # the answer arrived: the coordinator holds this rank's summary under its key from now on
    _READER.keep(pending.key, ReaderEntry(answer.key, transport), ENTRIES)
    plan_cache.finish("reader")
    stats.plan_cached = pending.plan_cached and pending.entry is not None
    stats.global_plan_cached = answer.plan is None
    return dataclasses.replace(plan, storage_data=transport)
