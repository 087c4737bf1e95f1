"""``UCPFileSystemReader``'s side of the load-plan cache (:mod:`ucp_dcp.planning.plan_cache`).

A mixin. A load planner whose plan is cached (``UCPLoadPlanner(cache_plans=True)``) puts its plan key in
``planner_data``; the reader then keys its read-once summary (:class:`KeyedSummary`): the key alone when this
process sent the summary to a coordinator in an earlier, finished load. The coordinator keeps summaries and
its read-once answers by key; it answers a rank that holds the very answer with a marker
(:class:`KeyedTransport` without a plan), which ``read_data`` resolves from this process's cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan

from ..errors import UCPError
from ..planning import plan_cache, plan_keys
from ..planning.payloads import LoadPlanPayload, ReadOnceMode, ReadSummary, TransportPlan
from ..planning.plan_cache import CachedLoadPlan, KeyedSummary, KeyedTransport, ReaderEntry
from .read_job import ReadStats
from .transport import local_summary

__all__ = ["KeyedReadPlans"]


class KeyedReadPlans:
    """The reader's plan-cache steps (a mixin; the state it reads is the reader's)."""

    _md: Any
    stats: ReadStats
    _keyed: tuple[bytes, ReaderEntry | None, bool] | None = None
    """A load with a cached plan: ``(reader key, the entry cached under it, whether the planner's plan was
    cached too)`` until the coordinator's answer arrives."""

    def _plan_transport(self, summaries: list[ReadSummary | None]) -> list[TransportPlan]:
        raise NotImplementedError  # the reader's

    def _summary(self, plan: LoadPlan, mode: ReadOnceMode) -> ReadSummary | KeyedSummary:
        """This rank's read-once summary; a planner's cached plan (its key in ``planner_data``) gets a keyed
        one: only the key when this process sent its summary to a coordinator before."""
        pd = plan.planner_data
        plan_key = pd.key if isinstance(pd, CachedLoadPlan) else getattr(pd, "cache_key", None)
        self._keyed = None
        if not isinstance(pd, (CachedLoadPlan, LoadPlanPayload)) or plan_key is None:
            return local_summary(plan.items, self._md, mode)
        key = plan_keys.reader_key(plan_key, type(self), mode)
        entry = plan_cache.reader_entry(key) if plan_cache.begin("reader") else None
        self._keyed = (key, entry, isinstance(pd, CachedLoadPlan))
        plan_cache.count("reader_hit" if entry is not None else "reader_miss")
        if entry is not None:
            return KeyedSummary(key, None, entry.answer_key)
        return KeyedSummary(key, local_summary(plan.items, self._md, mode))

    def _keyed_answers(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator's read-once answers: for the same reader keys on every rank the cached ones, and a
        marker for a rank that holds its own."""
        keyed = [p.storage_data if isinstance(p.storage_data, KeyedSummary) else None for p in plans]
        keys = [k.key for k in keyed if k is not None]
        gkey = plan_keys.digest(b"ucp-load-transport-1", *keys) if len(keys) == len(plans) else None
        transports = plan_cache.cached_transports(gkey) if gkey is not None else None
        if transports is None:
            transports = self._plan_transport(self._summaries(plans))
            if gkey is not None:
                plan_cache.put_transports(gkey, transports)
        else:
            plan_cache.touch_summaries(keys)
        out = []
        for p, k, t in zip(plans, keyed, transports):
            answer: Any = t
            if k is not None:  # a rank that holds this very answer gets a marker of it
                answer = KeyedTransport(gkey, None if gkey is not None and k.last == gkey else t)
            out.append(dataclasses.replace(p, storage_data=answer))
        return out

    @staticmethod
    def _summaries(plans: list[LoadPlan]) -> list[ReadSummary | None]:
        """Every rank's summary: a keyed one's from the cache, where the coordinator keeps the others."""
        out: list[ReadSummary | None] = []
        for rank, p in enumerate(plans):
            sd = p.storage_data
            if isinstance(sd, KeyedSummary):
                if sd.summary is None:
                    sd = plan_cache.cached_summary(sd.key, rank)
                else:
                    plan_cache.remember_summary(sd.key, sd.summary, len(plans))
                    sd = sd.summary
            out.append(sd if isinstance(sd, ReadSummary) else None)
        return out

    def _answer(self, plan: LoadPlan) -> LoadPlan:
        """The plan with the coordinator's read-once answer: a keyed one resolved (a marker: the answer this
        rank holds) and cached for the next load."""
        keyed, self._keyed = self._keyed, None
        answer = plan.storage_data
        if not isinstance(answer, KeyedTransport):
            return plan
        if keyed is None:
            raise UCPError(
                f"{type(self).__name__}.read_data was given a keyed read-once answer for a plan this reader did "
                "not key in prepare_local_plan",
                hint="let dcp.load drive the reader: prepare_local_plan, the coordinator's prepare_global_plan, "
                "then read_data with the plan it answered",
            )
        key, entry, plan_cached = keyed
        transport = answer.plan
        if transport is None:
            if entry is None or entry.answer_key != answer.key:
                raise UCPError(
                    "the coordinator answered this rank with its cached read-once plan, which this process does "
                    "not hold",
                    hint="load again with cache_plans=False, or call ucp_dcp.planning.plan_cache.clear() on every rank",
                )
            transport = entry.transport
        plan_cache.put_reader(key, ReaderEntry(answer.key, transport))
        plan_cache.finish("reader")
        self.stats.plan_cached = plan_cached and entry is not None
        self.stats.global_plan_cached = answer.plan is None
        return dataclasses.replace(plan, storage_data=transport)
