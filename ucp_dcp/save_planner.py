"""``UCPSavePlanner``: writes every value as fragments of canonical atoms, plus the catalog."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, STATE_DICT_TYPE, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ._version import __version__
from .averaging import exchange_averages
from .checks import check_replica_digests, check_rule_usage, reduce_all
from .options import UCPOptions, split_options
from .patterns import Patterns
from .plans import LocalPlanPayload, PlanStructure, RankAnswer
from .resolve import Resolver
from .save_plan import build_local, final_items, global_plan, live_entries, local_payload, merge_cached, \
    structures_by_hash

__all__ = ["UCPSavePlanner"]

logger = logging.getLogger(__name__)

_CHECK_MODES = ("error", "warn", "off")


def _from_options(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}``")


class UCPSavePlanner(DefaultSavePlanner):
    """Save planner that stores parallelism-independent atoms.

    Args:
        options: the layout description shared with the load planner (:class:`UCPOptions`:
            ``patterns``, ``strict``, ``stage_map``, ``expert_map``, ``name_rules``, ``data_slot``),
            or those fields as keyword arguments.
        check_replicas: what to do when a plain tensor or object saved under one name by several
            ranks differs between them: ``"error"`` (default), ``"warn"`` or ``"off"``.
        dedup_save_to_lowest_rank, enable_plan_caching: as in ``DefaultSavePlanner``; with plan
            caching on, a changed *layout* (not only changed boxes) invalidates the cached plan.
    """

    def __init__(
        self,
        options: UCPOptions | None = None,
        *,
        check_replicas: str = "error",
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        **layout: Any,
    ) -> None:
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=enable_plan_caching,
        )
        if check_replicas not in _CHECK_MODES:
            raise ValueError(f"check_replicas must be one of {_CHECK_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        self.options = split_options(options, layout)
        self._config = {"check_replicas": check_replicas, "dedup_save_to_lowest_rank": dedup_save_to_lowest_rank,
                        "enable_plan_caching": enable_plan_caching}
        self._pending_local: tuple[bytes, bytes] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # async_save's process mode pickles the planner: it travels as its configuration, rebuilt
        # by __init__ on the other side, never with tensors, groups or a half-run plan
        return (_rebuild, (type(self), self.options, self._config))

    name_rules = _from_options("name_rules")
    rules = _from_options("patterns")
    strict = _from_options("strict")
    maps = _from_options("maps")
    data_slot = _from_options("data_slot")

    # -- local -------------------------------------------------------------------------------------

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        self._patterns = Patterns(self.rules, strict=self.strict)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, _ = self._resolver.resolve_state_dict(state_dict, for_load=False)
        self._resolved, self._ties = live_entries(resolved)
        self.mappings = {a: p for r in self._resolved for a, p in r.paths.items()}
        self.state_dict = {r.name: r.value for r in self._resolved}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self._local = build_local(self._resolved, self.mappings, self.check_replicas)
        payload = local_payload(self._local, self._resolved, self._ties, self._patterns, self.options,
                                self.is_coordinator)
        self.plan = SavePlan([], planner_data=payload)
        if self._enable_plan_caching:
            sent = (payload.packed.structure_hash, payload.packed.items)
            if self._cache().local == sent:
                logger.info("UCP: local plan and layout unchanged; reusing the cached global plan")
                return SavePlan([], usable=False, planner_data=payload.with_packed(None))
            self._pending_local = sent
        return self.plan

    # -- coordinator -------------------------------------------------------------------------------

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self._cache()
        payloads: list[LocalPlanPayload] = merge_cached([p.planner_data for p in all_plans], cache.payloads)
        maps = {m.key: m.total for m in self.maps}
        check_rule_usage(self._patterns, [p.usage for p in payloads], maps, "at save")
        structures = structures_by_hash([p.packed for p in payloads], cache.structures)
        check_replica_digests(payloads, structures, self.check_replicas)
        self._reduced = reduce_all(self._patterns, payloads)
        if self._enable_plan_caching and not any(p.usable for p in all_plans) and cache.global_plan is not None:
            return [SavePlan([], usable=False)] * len(all_plans), cache.global_plan[1]
        answers, metadata = global_plan(payloads, self._reduced, self.dedup_save_to_lowest_rank, _writer_info(),
                                        self._patterns.to_json(), [m.key for m in self.maps])
        plans = [SavePlan([], planner_data=a) for a in answers]
        if self._enable_plan_caching:
            cache.payloads, cache.structures, cache.global_plan = payloads, structures, (plans, metadata)
        return plans, metadata

    # -- all ranks, after the global plan succeeded ----------------------------------------------------

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        cache = self._cache()
        if not new_plan.usable:
            new_plan = cache.final
        elif self._enable_plan_caching:
            cache.final = new_plan
        if self._enable_plan_caching and self._pending_local is not None:
            cache.local, self._pending_local = self._pending_local, None
        answer: RankAnswer = new_plan.planner_data
        items = final_items(self._local.structure, self._local.items, answer)
        self._averaged = exchange_averages(answer.averages, self._resolved) if answer.exchange else {}
        self.plan = replace(new_plan, items=items, planner_data=None)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        name = write_item.index.fqn
        reduced = getattr(self, "_reduced", {})
        if name in reduced:
            return _as_data(reduced[name], write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            r, _ = self._local.pieces[(name, None)]
            return _as_data(r.value, write_item)
        offsets = tuple(write_item.index.offset)
        r, f = self._local.pieces[(name, offsets)]
        if f is None:
            return torch.empty(tuple(r.atoms[name]["shape"]), dtype=r.local.dtype)
        averaged = getattr(self, "_averaged", {}).get((name, offsets))
        return averaged if averaged is not None else f.view(r.local).detach()

    def _cache(self) -> PlanCache:
        if not self._enable_plan_caching:
            return PlanCache()
        return _CACHE.setdefault(self._cached_plans_key, PlanCache())


def _as_data(value: Any, item: WriteItem) -> torch.Tensor | io.BytesIO:
    if item.type != WriteItemType.BYTE_IO:
        return value
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf


@dataclass
class PlanCache:
    """The last successful save's plans, for one planner class (as DCP's class-level caches)."""

    local: tuple[bytes, bytes] | None = None
    """This rank: structure hash and items of the local plan it sent."""
    payloads: list[LocalPlanPayload] | None = None
    """The coordinator: every rank's payload, packed plans included."""
    structures: dict[bytes, PlanStructure] | None = None
    """The coordinator: their structures, decoded."""
    global_plan: tuple[list[SavePlan], Metadata] | None = None
    """The coordinator: its answers and the metadata."""
    final: SavePlan | None = None
    """This rank: the coordinator's answer."""


_CACHE: dict[str, PlanCache] = {}
"""Plan caches by planner class name."""


def _writer_info() -> dict[str, str]:
    return {"ucp_dcp": __version__, "torch": torch.__version__.split("+")[0]}


def _rebuild(cls: type, options: UCPOptions, config: dict[str, Any]) -> Any:
    return cls(options, **config)
