"""``UCPLoadPlanner``'s side of the load-plan cache (``cache_plans=True``, :mod:`ucp_dcp.planning.plan_cache`).

A mixin: the steps ``create_local_plan``, ``create_global_plan`` and ``finish_plan`` call. A hit skips the
rank's planning -- the saved index, every entry's reads, the checks, the cuts for staging -- and sets up
what the read step needs from the *current* targets: sinks of non-tensor values, the param groups'
collectors (their reads planned again: they hold this load's group dicts), fused targets loaded unsplit,
targets to zero.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..errors import UCPError
from . import device as _device
from . import plan_cache
from .device import staging_forced
from .entries import set_value
from .hooks import overrides
from .load_steps import GROUP_SINK, group_reads, raw_params_sink, split_stock_groups, use_unsplit
from .payloads import LoadPlanPayload
from .plan_cache import CachedLoadPlan, LocalEntry

__all__ = ["CachedLoadPlans", "PLANNING_HOOKS", "plan_key_of"]

logger = logging.getLogger("ucp_dcp.planning.load_planner")

PLANNING_HOOKS = ("create_local_plan", "create_global_plan", "_saved_index", "_read_catalog", "_staged")
"""Hooks whose override turns the plan cache off (what they return may depend on more than the key)."""


def plan_key_of(planner_data: Any) -> bytes | None:
    """The plan key a rank's ``planner_data`` carries (a cached plan's marker, or a payload to cache)."""
    if isinstance(planner_data, CachedLoadPlan):
        return planner_data.key
    if isinstance(planner_data, LoadPlanPayload):
        return planner_data.cache_key
    return None


class CachedLoadPlans:
    """``UCPLoadPlanner``'s plan-cache steps (a mixin; the state it reads is the planner's)."""

    _hook_base: type
    _config: dict[str, Any]
    _targets: dict[str, Any]
    _raw: Any
    _groups: Any
    _resolver: Any
    _patterns: Any
    _reads: list[ReadItem]
    _sinks: dict[str, Callable[[Any], None]]
    _zero: list[Any]
    _untouched: set[str]
    _scratch: dict[int, Any]
    _compared: dict[str, str]
    _payload: Any
    options: Any
    metadata: Any
    is_coordinator: bool
    original_state_dict: Any
    missing_atoms: list[str]
    name_rules: Any

    def _init_plan_cache(self, cache_plans: bool) -> None:
        self.cache_plans = bool(cache_plans)
        self._cache_key: bytes | None = None
        self.plan_cache_hit: bool | None = None
        """The last ``create_local_plan``: True: reused this process's cached plan; False: planned (and cached
        it); None: not cached (``cache_plans=False``, an override of a planning hook, an unhashable layout)."""
        self.global_plan_cached: bool | None = None
        """The coordinator's last ``create_global_plan``: True: every rank's plan was one it had checked
        (nothing checked again); False: it checked; None: some plan was not keyed."""

    def _saved_index(self) -> Any: ...  # the planner's

    # -- a rank's plan -----------------------------------------------------------------------------------------

    def _plan_key(self) -> bytes | None:
        """The key of this rank's local plan: None when it is not cached."""
        if not self.cache_plans or any(overrides(self, self._hook_base, h) for h in PLANNING_HOOKS):
            return None
        md = plan_cache.metadata_digest(self.metadata)
        layout = plan_cache.target_signature(self._targets.values(), self._raw, self._groups)
        if md is None or layout is None:
            return None
        cls = type(self)
        return plan_cache.digest(
            b"ucp-load-plan-1",
            f"{cls.__module__}.{cls.__qualname__}",
            sorted(self._config.items()),
            self.options,
            md,
            layout,
            self.is_coordinator,
            staging_forced(),
            _device.STAGE_BYTES,
        )

    def _cached_local_plan(self) -> LoadPlan | None:
        """This rank's cached plan, set up on the current targets (None: plan it; then :meth:`_remember_plan`)."""
        self.__dict__.pop("_pending_entry", None)
        self._cache_key = key = self._plan_key()
        self.plan_cache_hit = None if key is None else False
        if key is None:
            return None
        entry = plan_cache.local_entry(key) if plan_cache.begin("planner") else None
        group = self._group_reads_again(entry) if entry is not None and entry.group_reads else ([], {})
        if entry is None or group is None:
            plan_cache.count("local_miss")
            return None
        sinks: dict[str, Callable[[Any], None]] = {}
        for k in entry.object_sinks:
            r = self._targets[k]
            sinks[k] = raw_params_sink(r, self._raw) or self._object_sink(r.entry.path)
        fresh, more = group  # the groups' collectors hold this load's group dicts: planned again
        sinks.update(more)
        for k in entry.unsplit:
            use_unsplit(self._targets[k])
        self._sinks, self._untouched, self._scratch = sinks, set(), {}
        self._compared = dict(entry.compared)
        self._zero = [self._targets[k] for k in entry.zero]
        self.missing_atoms = list(entry.missing)
        if self.missing_atoms:
            logger.warning(
                "UCP partial load: %d atom(s) not in the checkpoint were left as they are: %s",
                len(self.missing_atoms),
                ", ".join(self.missing_atoms[:10]),
            )
        self._patterns.used.update(entry.payload.usage.used)
        self._reads = entry.reads[: len(entry.reads) - len(fresh)] + fresh
        self._payload = CachedLoadPlan(key, entry.payload.read_once, entry.payload.keeps_items)
        self._pending_entry = entry
        self.plan_cache_hit = True
        plan_cache.count("local_hit")
        return LoadPlan(self._reads, planner_data=self._payload)

    def _object_sink(self, path: tuple[Any, ...]) -> Callable[[Any], None]:
        """Where a loaded object goes (``create_local_plan``'s sink of a non-tensor target)."""
        return object_sink(self.original_state_dict, path)

    def _group_reads_again(self, entry: LocalEntry) -> tuple[list[ReadItem], dict[str, Callable[[Any], None]]] | None:
        """The param groups' reads and sinks for this load's group dicts, as planned (None: they differ)."""
        saved = self._saved_index()
        reads: list[ReadItem] = []
        sinks: dict[str, Callable[[Any], None]] = {}
        try:
            rest, stock = split_stock_groups(self._groups, saved, self._resolver, self.name_rules)
            for g in rest:
                group, more, _ = group_reads(g, saved, self._resolver)
                reads += group
                sinks.update(more)
        except UCPError:
            return None
        for found in stock:
            sinks.update(found.sinks)
        reads += [r for found in stock for r in found.reads]
        if [(it.storage_index.fqn, it.type) for it in reads] != entry.group_reads:
            return None
        return reads, sinks

    def _remember_plan(self, payload: LoadPlanPayload) -> LoadPlanPayload:
        """After planning: the payload with this plan's key, and what a later hit of the plan needs (cached when
        the coordinator's answer arrives). The param groups' reads are the plan's last (objects: never cut for
        staging)."""
        if self._cache_key is None:
            return payload
        payload = dataclasses.replace(payload, cache_key=self._cache_key)
        n = 0
        while n < len(self._reads) and self._reads[-1 - n].dest_index.fqn.startswith(GROUP_SINK):
            n += 1
        group = self._reads[len(self._reads) - n :]
        if any(it.type != LoadItemType.BYTE_IO for it in group):
            return payload
        self._pending_entry = LocalEntry(
            reads=list(self._reads),
            payload=payload,
            missing=list(self.missing_atoms),
            zero=[r.entry.key for r in self._zero],
            unsplit=[k for k, r in self._targets.items() if r.unsplit is not None and r.fragments is r.unsplit],
            object_sinks=[k for k in self._sinks if k in self._targets],
            group_reads=[(it.storage_index.fqn, it.type) for it in group],
            compared=dict(self._compared),
        )
        return payload

    def _commit_plan(self, answer: LoadPlan) -> None:
        """``finish_plan``: the coordinator's answer arrived (not the local plan itself: no global step), so
        it holds this rank's plan under its key now."""
        pending = self.__dict__.pop("_pending_entry", None)
        if pending is not None and self._cache_key is not None and plan_key_of(answer.planner_data) is None:
            plan_cache.put_local(self._cache_key, pending)
            plan_cache.finish("planner")

    # -- the coordinator -----------------------------------------------------------------------------------------

    def _checks_key(self, global_plan: list[LoadPlan]) -> bytes | None:
        """The key of the coordinator's checks of these plans: its own plan key and every rank's (None: some
        plan, or the coordinator's own, is not keyed)."""
        keys = [plan_key_of(p.planner_data) for p in global_plan]
        if self._cache_key is None or any(k is None for k in keys):
            return None
        return plan_cache.digest(b"ucp-load-checks-1", self._cache_key, *keys)

    def _reused_checks(self, global_plan: list[LoadPlan]) -> bytes | None:
        """Whether every rank's plan is one the coordinator's checks passed for (``global_plan_cached``);
        returns the key to mark them passed with (:meth:`_passed_checks`)."""
        key = self._checks_key(global_plan)
        self.global_plan_cached = None if key is None else plan_cache.checks_passed(key)
        if self.global_plan_cached:
            plan_cache.touch_payloads(plan_key_of(p.planner_data) for p in global_plan)
        return key

    def _passed_checks(self, key: bytes | None) -> None:
        if key is not None:
            plan_cache.pass_checks(key)

    def _payloads(self, global_plan: list[LoadPlan]) -> list[Any]:
        """Every rank's payload: a cached plan's from the cache (which keeps the others' by their keys)."""
        out: list[Any] = []
        for rank, p in enumerate(global_plan):
            pd = p.planner_data
            if isinstance(pd, CachedLoadPlan):
                pd = plan_cache.cached_payload(pd.key, rank)
            elif isinstance(pd, LoadPlanPayload) and pd.cache_key is not None:
                plan_cache.remember_payload(pd.cache_key, pd, len(global_plan))
            out.append(pd)
        return out


def object_sink(state_dict: Any, path: tuple[Any, ...]) -> Callable[[Any], None]:
    """The sink that puts a loaded object at ``path`` of ``state_dict``.

    It holds the state dict, not the planner: a closure over the planner, kept in the planner's own sinks,
    made the planner, the checkpoint's metadata and the plans one reference cycle per load, which only a
    full collection frees -- at 16 ranks a 0.25 s pause that landed inside some rank's planning and held
    every other rank at the next collective."""
    return lambda v: set_value(state_dict, path, v)
