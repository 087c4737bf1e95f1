"""``UCPSavePlanner``: writes every value as fragments of canonical atoms, plus the catalog."""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.tensor import DTensor

from .._compat import cached_plans_key, local_tensor, plan_caching
from .._version import __version__
from ..errors import InvalidArgumentError, UCPError
from ..layout.patterns import Patterns
from ..layout.structure import catalog_meshes, check_mesh_collisions, map_orders, tied_atoms
from ..options import UCPOptions, options_first, protocol_error, require_flat, split_options
from .catalog import merge_raw_optimizers
from .checkpoint_group import mark
from .consistency import check_replica_digests, check_rule_usage, reduce_all
from .entries import raw_optimizers
from .faults import fault_point
from .hooks import SaveHooks, check_state_dict, offered_items, plan_snapshot, snapshot, state_view
from .payloads import LocalPlanPayload, PlanStructure, RankAnswer, has_dtype_code
from .resolve import Resolver
from .save_steps import (
    build_local,
    exchange_averages,
    final_items,
    global_plan,
    live_entries,
    local_payload,
    merge_cached,
    structures_by_hash,
)
from .ties import fold_shared_storage

__all__ = ["UCPSavePlanner"]

logger = logging.getLogger(__name__)

CheckMode = Literal["error", "warn", "off"]
"""What to do when replicas differ at save (``check_replicas``)."""
_CHECK_MODES = get_args(CheckMode)
ReplicaDigests = Literal["plan", "writer"]
"""Where replica digests come from: hashed by the planner, or the writer's block checksums."""


def _from_options(name: str) -> property:
    return property(lambda self: getattr(self.options, name), doc=f"``options.{name}``")


class UCPSavePlanner(SaveHooks, DefaultSavePlanner):
    """Save planner that stores parallelism-independent atoms.

    A drop-in for ``DefaultSavePlanner``: the first five parameters are DCP's, in DCP's order and
    with DCP's meaning; ucp_dcp's own options are keyword-only after them.

    Args:
        flatten_state_dict: as in DCP. ``True`` (default): nested dicts and lists are saved leaf by
            leaf under their dotted keys. ``False``: the state dict must already be flat (no nested
            containers); then nothing changes. A nested one raises :class:`UCPError` at
            ``set_up_planner``: DCP would save each nested container as one pickled object, which
            cannot be resharded or renamed.
        flatten_sharded_tensors: as in DCP; it only concerns nested (2-D) ``ShardedTensor`` values,
            which DCP's planner first flattens into one. ucp_dcp never needs that step (it plans each
            value from the boxes of memory it holds, or refuses it), so both values behave the same.
        dedup_replicated_tensors: as in DCP: deprecated, no effect (DCP logs a warning when given).
        dedup_save_to_lowest_rank: as in DCP: a piece several ranks hold is written by the lowest of
            them, instead of the one with the least planned bytes.
        enable_plan_caching: as in DCP: a rank whose local plan did not change sends none and the
            coordinator reuses its last global plan; a changed *layout* (not only changed boxes)
            also invalidates the cached plan.
        options: the layout description shared with the load planner (:class:`UCPOptions`:
            ``patterns``, ``strict``, ``stage_map``, ``expert_map``, ``name_rules``, ``data_slot``),
            or those fields as keyword arguments.
        check_replicas: what to do when copies of one value differ between ranks (plain tensors
            and objects saved under one name, replicated DTensor pieces, copies on meshes of other
            ranks): ``"error"`` (default), ``"warn"`` or ``"off"``.
        replica_digests: where replicated DTensor pieces are compared. ``"plan"`` (default): each
            holder hashes its copy while planning, with any storage writer. ``"writer"``: the copy
            that is written is compared after the write from the block checksums
            :class:`UCPFileSystemWriter` computes anyway (the other holders hash theirs meanwhile),
            before the commit; needs that writer with checksums on (``ucp_dcp.save`` uses it).

    Call order (DCP's): ``set_up_planner`` → ``create_local_plan`` → [coordinator:
    ``create_global_plan``] → ``finish_plan`` → ``resolve_data``. As with DCP's planner,
    ``finish_plan`` may also be given the local plan itself (one process, no global step): it then
    plans this rank alone, so the rank writes everything it holds. A missing step raises
    :class:`UCPError` naming it.

    Subclasses override DCP's hooks with DCP's meaning (``docs/concepts.md``, "Subclassing the
    planners"): ``resolve_data`` is ``lookup_object(index)`` + ``transform_object(item, obj)``, where
    ``index.fqn`` is the *atom* name and ``self.state_dict`` is keyed by atom names (the flattened
    key for plain keys; ``self.mappings[atom]`` is its path in the state dict given to
    ``set_up_planner``); the local plan lists its ``WriteItem``s, and an override of
    ``create_local_plan`` may drop items or change their dtype.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: bool | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
        *,
        options: UCPOptions | None = None,
        check_replicas: CheckMode = "error",
        replica_digests: ReplicaDigests = "plan",
        **layout: Any,
    ) -> None:
        options = options_first(flatten_state_dict, options, "UCPSavePlanner")
        super().__init__(
            flatten_state_dict=bool(flatten_state_dict),
            flatten_sharded_tensors=bool(flatten_sharded_tensors),
            dedup_replicated_tensors=dedup_replicated_tensors,
            dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
            enable_plan_caching=enable_plan_caching,
        )
        if check_replicas not in _CHECK_MODES:
            raise InvalidArgumentError(f"check_replicas must be one of {_CHECK_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        if replica_digests not in get_args(ReplicaDigests):
            raise InvalidArgumentError(f"replica_digests must be 'plan' or 'writer', got {replica_digests!r}")
        self.replica_digests = replica_digests
        self.options = split_options(options, layout)
        self._config = {
            "flatten_state_dict": self.flatten_state_dict,
            "flatten_sharded_tensors": self.flatten_sharded_tensors,
            "check_replicas": check_replicas,
            "dedup_save_to_lowest_rank": dedup_save_to_lowest_rank,
            "enable_plan_caching": enable_plan_caching,
            "replica_digests": replica_digests,
        }
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
        # the step this rank is at, for the watch: a peer that loses this rank names where it stopped
        mark("save", "planning")
        fault_point("save-plan")
        for stale in (
            "_resolved",
            "_local",
            "_state_view",
            "_global_offered",
        ):  # a reused planner: the previous save's plan is gone
            self.__dict__.pop(stale, None)
        if not self.flatten_state_dict:
            require_flat(state_dict, "save")
        # every entry becomes atoms (canonical names) and fragments (boxes of them) here, once: the local plan,
        # the global checks and the lookups of the write step all read this one resolution
        self._patterns = Patterns(self.rules, strict=self.strict)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, _ = self._resolver.resolve_state_dict(state_dict, for_load=False)
        # keys viewing one tensor (a tied embedding and head) are one atom, found from the state itself
        resolved, alias_paths = fold_shared_storage(resolved)
        self._resolved, self._ties = live_entries(resolved)
        for r in self._resolved:
            _check_savable(r.name, r.value)
        self.mappings = {a: p for r in self._resolved for a, p in r.paths.items()} | alias_paths
        self._raw = raw_optimizers(state_dict, self.name_rules, self._resolver.rewrite)
        self.state_dict = {r.name: r.value for r in self._resolved}
        self._keys = {a: r.entry.key for r in self._resolved for a in r.atoms}
        self._state_view = state_view(self.state_dict)
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        check_state_dict(self, "UCPSavePlanner")
        if not hasattr(self, "_resolved"):
            raise protocol_error("create_local_plan", "set_up_planner(state_dict)")
        self.__dict__.pop("_local", None)
        items = offered_items(self._resolved)  # DCP's local plan: one item per piece, as DCP lists them
        self._offered = snapshot(items)
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def _outer_create_local_plan(self, call: Any) -> SavePlan:
        """After the outermost ``create_local_plan`` (an override's included): plan the items it
        kept, packed for the gather (DCP's coordinator would get them as objects)."""
        # DCP's contract first: an override of create_local_plan sees (and may edit) DCP-style items; only then
        # is the plan replaced by our compact payload, which carries the layout the coordinator checks
        plan = call()
        pieces = self._item_edits(plan)  # what an override dropped or retyped (SaveHooks)
        self._local = build_local(
            self._resolved,
            self.mappings,
            self.check_replicas,
            defer_pieces=self.replica_digests == "writer" and self.check_replicas == "error",
            raw_optimizers=self._raw,
            dropped=pieces,
            dtypes=self._dtypes,
        )
        # packed (a structure hash and item rows, planning/payloads), not SavePlan items: the gather to the
        # coordinator is the part of a save that grows with the ranks, so it carries the compact form
        payload = local_payload(
            self._local, self._resolved, self._ties, self._patterns, self.options, self.is_coordinator
        )
        self.plan = SavePlan([], planner_data=payload)
        if plan_caching(self):  # DCP's enable_plan_caching: an unchanged local plan is sent as "unusable"
            sent = (payload.packed.structure_hash, payload.packed.items)
            if self._cache().local == sent:
                logger.info("UCP: local plan and layout unchanged; reusing the cached global plan")
                return SavePlan([], usable=False, planner_data=payload.with_packed(None))
            self._pending_local = sent
        return self.plan

    # -- coordinator -------------------------------------------------------------------------------

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return self._plan_globally(self._unedited(all_plans))

    def _plan_globally(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        foreign = [i for i, p in enumerate(all_plans) if not isinstance(p.planner_data, LocalPlanPayload)]
        if foreign:
            raise UCPError(
                f"create_global_plan: the plan(s) of rank(s) {foreign} were not made by UCPSavePlanner.create_local_plan",
                hint="give every rank a UCPSavePlanner and pass create_global_plan the plans their create_local_plan "
                "returned",
            )
        if not hasattr(self, "_patterns"):  # a coordinator that planned nothing itself: its own rules
            self._patterns = Patterns(self.rules, strict=self.strict)
        plans, self.metadata = self._global_plan(all_plans)
        self.global_plan = plans  # as DCP's planner keeps them
        return plans, self.metadata

    def _global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cache = self._cache()
        payloads: list[LocalPlanPayload] = merge_cached([p.planner_data for p in all_plans], cache.payloads)
        maps = {m.key: m.total for m in self.maps}
        check_rule_usage(self._patterns, [p.usage for p in payloads], maps, "at save")
        structures = structures_by_hash([p.packed for p in payloads], cache.structures)
        # facts before declarations: whole tensors from different meshes are not replicas, nor are raw
        # optimizer entries of ranks that number other parameters
        merge_raw_optimizers([st.catalog for st in structures.values()])
        meshes = catalog_meshes([st.catalog for st in structures.values()])
        check_mesh_collisions(meshes, tied_atoms(self._patterns, structures.values()), "at save")
        check_replica_digests(payloads, structures, self.check_replicas, meshes)
        self._reduced = reduce_all(self._patterns, payloads)
        # the checks above ran on every rank's payload, cached or not; only the global plan itself is reused,
        # and only when no rank's local plan changed
        if plan_caching(self) and not any(p.usable for p in all_plans) and cache.global_plan is not None:
            return [SavePlan([], usable=False)] * len(all_plans), cache.global_plan[1]
        answers, metadata = global_plan(
            payloads,
            self._reduced,
            self.dedup_save_to_lowest_rank,
            _writer_info(),
            self._patterns.to_json(),
            [m.key for m in self.maps],
            map_orders([p.usage for p in payloads]),
        )
        plans = [SavePlan([], planner_data=a) for a in answers]
        if plan_caching(self):
            cache.payloads, cache.structures, cache.global_plan = payloads, structures, (plans, metadata)
        return plans, metadata

    # -- all ranks, after the global plan succeeded ----------------------------------------------------

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not hasattr(self, "_local"):
            raise protocol_error("finish_plan", "create_local_plan()")
        if isinstance(new_plan.planner_data, LocalPlanPayload):
            # the local plan itself, with no global step (DCP's planner takes it as final): plan this
            # rank alone, as a one-rank save would
            new_plan = replace(self._plan_globally([new_plan])[0][0], storage_data=new_plan.storage_data)
        elif new_plan.usable and not isinstance(new_plan.planner_data, RankAnswer):
            raise UCPError(
                "finish_plan was given a plan that is neither this planner's local plan nor the coordinator's "
                "answer from UCPSavePlanner.create_global_plan",
                hint="pass finish_plan the plan create_global_plan returned for this rank (or, in one process, "
                "the plan create_local_plan returned)",
            )
        cache = self._cache()
        if not new_plan.usable:  # the coordinator reused its global plan: this rank's answer is the one it kept
            new_plan = cache.final
        elif plan_caching(self):
            cache.final = new_plan
        if plan_caching(self) and self._pending_local is not None:
            cache.local, self._pending_local = self._pending_local, None
        answer: RankAnswer = new_plan.planner_data
        items = final_items(self._local.structure, self._local.items, answer)
        self._averaged = exchange_averages(answer.averages, self._resolved) if answer.exchange else {}
        self._verify = list(answer.verify)
        self.plan = replace(new_plan, items=items, planner_data=None)
        self._final = plan_snapshot(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # DCP's: the lookup, then the transform (a BYTE_IO object is serialized by transform_object)
        return self.transform_object(write_item, self.lookup_object(write_item.index))

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The value of atom ``index.fqn``: an object, or the piece at ``index.offset`` (as DCP's
        lookup returns a DTensor's shard)."""
        name = index.fqn
        reduced = getattr(self, "_reduced", {})
        if name in reduced:
            return reduced[name]
        if index.offset is None:
            r, _ = self._local.pieces[(name, None)]
            return r.value
        offsets = tuple(index.offset)
        r, f = self._local.pieces[(name, offsets)]
        if f is None:
            return torch.empty(tuple(r.atoms[name]["shape"]), dtype=r.local.dtype)
        averaged = getattr(self, "_averaged", {}).get((name, offsets))
        if averaged is not None:
            return averaged
        # a conjugate or negative view is saved as the values it shows (the writer copies bytes)
        return f.view(r.local).detach().resolve_conj().resolve_neg()

    def key_of(self, index: MetadataIndex) -> str:
        """The flattened key (DCP's ``index.fqn``) of the state-dict entry atom ``index.fqn`` comes from:
        a ``lookup_object`` override that looks values up by the user's keys maps the atom name with it."""
        return self._keys[index.fqn]

    def replica_copies(self) -> list[tuple[MetadataIndex, torch.Tensor]]:
        """This rank's copies of replicated pieces another rank writes (``replica_digests="writer"``):
        the storage writer hashes them and compares them with the written copy before the commit."""
        out = []
        for name, offsets in getattr(self, "_verify", ()):
            r, f = self._local.pieces[(name, tuple(offsets))]
            out.append((MetadataIndex(name, torch.Size(offsets)), self._copy_as_written(name, r, f)))
        return out

    def _cache(self) -> PlanCache:
        if not plan_caching(self):
            return PlanCache()
        return _CACHE.setdefault(cached_plans_key(self), PlanCache())


def _check_savable(name: str, value: Any) -> None:
    """Refuse, naming the atom, a tensor DCP cannot save (stock DCP fails on it too, deep inside)."""
    if not isinstance(value, torch.Tensor):
        return
    if not has_dtype_code(value.dtype):
        raise UCPError(
            f"atom '{name}': tensors of dtype {value.dtype} cannot be saved (DCP has no storage for it; stock "
            "dcp.save fails on it too)",
            atom=name,
            saved=str(value.dtype),
            hint="save its packed bytes as a torch.uint8 tensor (t.view(torch.uint8) where torch allows it) or "
            "convert it to a standard dtype, and convert back after loading",
        )
    local = local_tensor(value) if isinstance(value, DTensor) else value
    if isinstance(local, torch.Tensor) and local.layout != torch.strided:
        raise UCPError(
            f"atom '{name}': a {local.layout} tensor cannot be saved (DCP saves dense strided tensors; stock "
            "dcp.save fails on it too)",
            atom=name,
            saved=str(local.layout),
            hint="save t.to_dense(), or the tensor's parts (e.g. indices() and values()) as separate entries, "
            "and rebuild it after loading",
        )


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
    return cls(options=options, **config)
