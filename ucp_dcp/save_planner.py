"""``UCPSavePlanner``: writes every value as fragments of canonical atoms, plus the catalog."""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    STATE_DICT_TYPE,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
from torch.distributed.tensor import DTensor

from . import catalog as cat_mod
from .dedup import balanced_dedup
from .digests import value_digest
from .errors import AmbiguousLayoutError, CoverageError, PatternError
from .fragments import Fragment
from .layout import Layout
from .naming import NameRules
from .patterns import Patterns, Rule
from .renumber import IndexMap
from .replicas import check_digests, check_rules_and_ownership, reduce_values
from .resolve import Resolved, Resolver

__all__ = ["UCPSavePlanner"]

logger = logging.getLogger(__name__)

_CHECK_MODES = ("error", "warn", "off")


class UCPSavePlanner(DefaultSavePlanner):
    """Save planner that stores parallelism-independent atoms.

    Args:
        patterns: pattern rules (:mod:`ucp_dcp.patterns`) for layouts DTensor cannot describe.
        strict: a declared rule that matches nothing on any rank is an error.
        stage_map, expert_map: this rank's local->global layer / expert numbering
            (:mod:`ucp_dcp.renumber`), for stage-local or expert-local module names.
        check_replicas: what to do when a plain tensor or object saved under one name by several
            ranks differs between them: ``"error"`` (default), ``"warn"`` or ``"off"``.
        data_slot: this rank's data-parallel slot, for ``Reduce`` rules: ranks of one slot (TP/PP
            replicas that saw the same data) hold copies of one value, which must agree and count
            once. Default: every rank is its own slot.
        name_rules: wrapper segments stripped from names.
        dedup_save_to_lowest_rank, enable_plan_caching: as in ``DefaultSavePlanner``; with plan
            caching on, a changed *layout* (not only changed boxes) invalidates the cached plan.
    """

    def __init__(
        self,
        *,
        patterns: Sequence[Rule] = (),
        strict: bool = True,
        stage_map: IndexMap | None = None,
        expert_map: IndexMap | None = None,
        check_replicas: str = "error",
        data_slot: int | None = None,
        name_rules: NameRules | None = None,
        dedup_save_to_lowest_rank: bool = False,
        enable_plan_caching: bool = False,
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
        self.name_rules = name_rules or NameRules()
        self.rules = tuple(patterns)
        Patterns(self.rules)  # validate regexes now, not mid-save
        self.strict = strict
        self.maps = tuple(m for m in (stage_map, expert_map) if m is not None)
        self.data_slot = data_slot

    def __getstate__(self) -> dict[str, Any]:
        # async_save's process mode pickles the planner: ship configuration, never tensors or groups
        keep = {"check_replicas", "name_rules", "rules", "strict", "maps", "dedup_save_to_lowest_rank", "data_slot",
                "_enable_plan_caching", "_cached_plans_key", "flatten_state_dict", "flatten_sharded_tensors"}
        return {k: v for k, v in self.__dict__.items() if k in keep} | {"mappings": {}}

    # -- local -------------------------------------------------------------------------------------

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        self._patterns = Patterns(self.rules, strict=self.strict)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, _ = self._resolver.resolve_state_dict(state_dict, for_load=False)
        owner: dict[str, Resolved] = {}
        self._resolved: list[Resolved] = []
        self._ties: list[tuple[Resolved, Resolved]] = []
        for r in resolved:
            if not r.present:
                continue
            if isinstance(r.value, DTensor) and Layout.from_dtensor(r.value).partial_dims():
                raise AmbiguousLayoutError(
                    f"atom '{r.name}' has a Partial placement ({Layout.from_dtensor(r.value).describe()}); its "
                    "logical value is a pending reduction, not a tensor",
                    atom=r.name, saved=Layout.from_dtensor(r.value).describe(),
                    hint="redistribute to Replicate/Shard (e.g. `.redistribute(placements=...)`) before saving",
                )
            clash = next((owner[a] for a in r.atoms if a in owner), None)
            if clash is not None:
                if r.tied and clash.tied:  # a second copy of a tied parameter on this rank: compare, save once
                    self._ties.append((clash, r))
                    continue
                raise AmbiguousLayoutError(
                    f"atom '{next(a for a in r.atoms if a in owner)}' is produced by two live keys: "
                    f"'{clash.entry.key}' and '{r.entry.key}'",
                    atom=next(a for a in r.atoms if a in owner),
                    hint="the keys differ only by wrapper segments (or two rules map them to one atom); save "
                    "one of them, declare them Tied, or pass name_rules that keep the distinguishing segment",
                )
            for a in r.atoms:
                owner[a] = r
            self._resolved.append(r)
        self.mappings = {a: p for r in self._resolved for a, p in r.paths.items()}
        self.state_dict = {r.name: r.value for r in self._resolved}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        self._pieces: dict[tuple[str, tuple[int, ...] | None], tuple[Resolved, Fragment | None]] = {}
        local_cat = cat_mod.local_catalog()
        digests: dict[str, int] = {}
        reduce_vals: dict[str, Any] = {}
        for r in self._resolved:
            for name, rec in r.atoms.items():
                rec = dict(rec)
                if "layout" in rec:
                    rec["layout"] = {"mesh": cat_mod.intern(local_cat["meshes"], rec["layout"]["mesh"]),
                                     "placements": rec["layout"]["placements"]}
                local_cat["atoms"][name] = rec
            if r.reduce is not None:
                for name in r.atoms:
                    reduce_vals[name] = r.value.detach().cpu().clone() if isinstance(r.value, torch.Tensor) else r.value
                continue
            if not isinstance(r.value, torch.Tensor):
                for name in r.atoms:
                    items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
                    self._pieces[(name, None)] = (r, None)
                    self._digest(digests, name, r.value)
                continue
            items.extend(self._tensor_items(r))
            if not isinstance(r.value, DTensor):
                if r.replicated is None or r.replicated.check in ("error", "warn"):
                    for name in r.atoms:
                        self._digest(digests, name, r.value)
            elif r.tied or (r.replicated is not None and r.replicated.check in ("error", "warn")):
                for f in r.fragments:
                    digests[_frag_key(f)] = value_digest(f.view(r.local))
        mismatch = self._local_tie_mismatches()
        self._warn_keys = {k for r in self._resolved if r.replicated is not None and r.replicated.check == "warn"
                           for k in r.atoms}
        plan = SavePlan(
            items,
            planner_data={
                "mappings": self.mappings, "catalog": local_cat, "digests": digests, "reduce": reduce_vals,
                "slot": self.data_slot,
                "local_mismatch": mismatch, "used": sorted(self._patterns.used),
                "claims": [c for r in self._resolved for c in r.index_claims],
                "map_totals": {m.key: m.total for m in self.maps},
                "used_maps": sorted(self._resolver.used_maps), "coordinator": self.is_coordinator,
                "warn_keys": sorted(self._warn_keys),
                "average": sorted({_avg_key(f) for r in self._resolved if _averaged(r) for f in r.fragments}),
                "global_rank": dist.get_rank() if dist.is_initialized() else 0,
            },
        )
        self.plan = plan
        if self._enable_plan_caching:
            cached = SavePlanner._cached_save_plan.get(self._cached_plans_key)
            if cached is not None and _same_local_plan(plan, cached):
                logger.info("UCP: local plan and layout unchanged; reusing the cached global plan")
                small = {k: v for k, v in plan.planner_data.items() if k not in ("mappings", "catalog")}
                return SavePlan([], usable=False, planner_data=small)
            self._pending_local_plan = plan
        return plan

    def _tensor_items(self, r: Resolved) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(r.local)
        pieces: list[tuple[str, Fragment | None]] = [(f.atom, f) for f in r.fragments]
        if r.value.numel() == 0:  # keep empty atoms visible in the metadata: one empty chunk each
            pieces = [(name, None) for name in r.atoms]
        items = []
        for name, f in pieces:
            shape = tuple(r.atoms[name]["shape"])
            offsets = f.box.offsets if f is not None else (0,) * len(shape)
            sizes = f.box.sizes if f is not None else shape
            # DCP allows one TENSOR item per key: pieces of an atom (DTensor shards, fused blocks) are SHARDs
            whole = not isinstance(r.value, DTensor) and tuple(sizes) == shape
            items.append(WriteItem(
                index=MetadataIndex(name, offsets),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=props,
                    size=torch.Size(shape),
                ),
            ))
            self._pieces[(name, tuple(offsets))] = (r, f)
        return items

    def _digest(self, digests: dict[str, int], name: str, value: Any) -> None:
        if self.check_replicas == "off":
            return
        d = value_digest(value)
        if d is not None:
            digests[name] = d

    def _local_tie_mismatches(self) -> list[str]:
        bad = []
        for kept, dup in self._ties:
            if isinstance(kept.value, torch.Tensor):
                same = {_frag_key(f): value_digest(f.view(kept.local)) for f in kept.fragments} == {
                    _frag_key(f): value_digest(f.view(dup.local)) for f in dup.fragments}
            else:
                same = value_digest(kept.value) == value_digest(dup.value)
            if not same:
                bad.append(kept.name)
        return bad

    # -- coordinator -------------------------------------------------------------------------------

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        pds = [p.planner_data or {} for p in all_plans]
        check_rules_and_ownership(self._patterns, pds, {m.key: m.total for m in self.maps}, "at save")
        warn = {k for pd in pds for k in pd.get("warn_keys") or ()}
        check_digests(pds, self.check_replicas, warn_keys=warn)
        self._reduced = self._reduce(pds)
        return super().create_global_plan(all_plans)

    def _reduce(self, pds: list[dict[str, Any]]) -> dict[str, Any]:
        values: dict[str, dict[Any, list[Any]]] = {}
        for rank, pd in enumerate(pds):
            slot = pd.get("slot")
            for name, v in (pd.get("reduce") or {}).items():
                values.setdefault(name, {}).setdefault(("rank", rank) if slot is None else slot, []).append(v)
        out = {}
        for name, by_slot in values.items():
            rule = self._patterns.reduce(name)
            if rule is None:  # matched on another rank only: rules are the same everywhere
                raise PatternError(f"atom '{name}' is reduced on some ranks but no rule matches it here", atom=name)
            # copies within a data slot (TP/PP replicas) must agree; each slot counts once
            per_slot = [reduce_values("equal", copies, name) for _, copies in sorted(by_slot.items(), key=str)]
            out[name] = reduce_values(rule.op, per_slot, name)
        return out

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if self.dedup_save_to_lowest_rank:
            return super()._dedup_save_plans(all_plans)
        return balanced_dedup(all_plans)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        local_cats, mappings, plans = [], {}, []
        coordinator = next((i for i, p in enumerate(all_plans) if (p.planner_data or {}).get("coordinator")), 0)
        averages = _average_holders(all_plans)
        for p in all_plans:
            pd = p.planner_data or {}
            local_cats.append(pd.get("catalog"))
            mappings.update(pd.get("mappings") or {})
            plans.append(dataclasses.replace(p, planner_data=None))
        # reduced values are written once, by the coordinator, which holds the reduction
        reduced_items = [_reduced_item(name, v) for name, v in sorted(self._reduced.items())]
        plans[coordinator] = dataclasses.replace(plans[coordinator], items=[*plans[coordinator].items, *reduced_items])
        catalog = cat_mod.merge_local_catalogs(local_cats, writer=_writer_info())
        catalog["rules"] = self._patterns.to_json()
        catalog["maps"] = sorted({m.key for m in self.maps})
        deduped = self._dedup_save_plans(plans)
        deduped = _attach_average_writers(deduped, averages, all_plans)
        global_plan, metadata = create_default_global_save_plan(deduped)
        planner_data: dict[str, Any] = dict(mappings)
        planner_data[cat_mod.CATALOG_KEY] = catalog
        metadata = dataclasses.replace(metadata, planner_data=planner_data)
        errors = _validate_global_plan(global_plan, metadata)
        if errors:
            raise CoverageError(
                "saved chunks do not tile their atoms: " + "; ".join(errors)[:1000],
                hint="some rank holds an unexpected layout for these atoms (or a pattern rule describes it "
                "wrongly); check the layouts and rules named in the message",
            )
        return global_plan, metadata

    # -- all ranks, after the global plan succeeded ----------------------------------------------------

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self._averaged = self._average_replicas(plan)
        return plan

    def _average_replicas(self, plan: SavePlan) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
        """``Replicated(check="average")``: every holder of a replicated piece sends it to the rank
        that writes it, which saves the mean (point-to-point on the default group, so any save group
        works; keys are visited in the same order everywhere)."""
        todo = (plan.planner_data or {}).get("average") or {}
        if not todo:
            return {}
        if threading.current_thread() is not threading.main_thread():
            raise PatternError(
                "Replicated(check='average') needs collectives and cannot run inside async_save's "
                f"background thread (atom '{next(iter(todo))}')", atom=next(iter(todo)),
                hint="use a synchronous dcp.save, or check='error'/'warn' with async_save",
            )
        me = dist.get_rank()
        frags = {_avg_key(f): (r, f) for r in self._resolved if _averaged(r) for f in r.fragments}
        out = {}
        for key in sorted(todo):
            writer, holders = todo[key]
            r, f = frags[key]
            mine = f.view(r.local).detach().to(torch.float64).contiguous()
            if me != writer:
                dist.isend(mine, writer).wait()
                continue
            parts = {me: mine}
            bufs = {h: torch.empty_like(mine) for h in holders if h != me}
            for w in [dist.irecv(buf, h) for h, buf in bufs.items()]:
                w.wait()
            parts.update(bufs)
            total = sum(parts[h] for h in sorted(parts))
            out[(f.atom, f.box.offsets)] = (total / len(parts)).to(r.local.dtype)
        return out

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        name = write_item.index.fqn
        reduced = getattr(self, "_reduced", {})
        if name in reduced:
            return _as_data(reduced[name], write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            r, _ = self._pieces[(name, None)]
            return _as_data(r.value, write_item)
        offsets = tuple(write_item.index.offset)
        r, f = self._pieces[(name, offsets)]
        if f is None:
            return torch.empty(tuple(r.atoms[name]["shape"]), dtype=r.local.dtype)
        averaged = getattr(self, "_averaged", {}).get((name, offsets))
        if averaged is not None:
            return averaged
        return f.view(r.local).detach()


def _as_data(value: Any, item: WriteItem) -> torch.Tensor | io.BytesIO:
    if item.type != WriteItemType.BYTE_IO:
        return value
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf


def _reduced_item(name: str, value: Any) -> WriteItem:
    if not isinstance(value, torch.Tensor):
        return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
    zeros = (0,) * value.ndim
    return WriteItem(
        index=MetadataIndex(name, zeros),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=value.shape),
            properties=TensorProperties.create_from_tensor(value),
            size=value.shape,
        ),
    )


def _averaged(r: Resolved) -> bool:
    return r.replicated is not None and r.replicated.check == "average" and isinstance(r.value, torch.Tensor)


def _avg_key(f: Fragment) -> str:
    return f"{f.atom}@{','.join(map(str, f.box.offsets))}"


def _average_holders(all_plans: list[SavePlan]) -> dict[str, list[int]]:
    """Averaged piece -> global ranks holding it."""
    holders: dict[str, list[int]] = {}
    for p in all_plans:
        pd = p.planner_data or {}
        for key in pd.get("average") or ():
            holders.setdefault(key, []).append(pd.get("global_rank", 0))
    return holders


def _attach_average_writers(
    deduped: list[SavePlan], holders: dict[str, list[int]], all_plans: list[SavePlan]
) -> list[SavePlan]:
    """Tell every holder of an averaged piece which rank writes it (that rank averages)."""
    if not holders:
        return deduped
    rank_of = [(p.planner_data or {}).get("global_rank", 0) for p in all_plans]
    writer: dict[str, int] = {}
    for i, p in enumerate(deduped):
        for it in p.items:
            key = f"{it.index.fqn}@{','.join(map(str, it.index.offset or ()))}"
            if key in holders:
                writer[key] = rank_of[i]
    out = []
    for i, p in enumerate(deduped):
        mine = {k: (writer[k], sorted(h)) for k, h in holders.items() if rank_of[i] in h and k in writer}
        out.append(dataclasses.replace(p, planner_data={"average": mine} if mine else None))
    return out


def _frag_key(f: Fragment) -> str:
    return f"{f.atom}@{list(f.box.offsets)}/{list(f.box.sizes)}"


def _same_local_plan(plan: SavePlan, cached: SavePlan) -> bool:
    """DCP's cache compares boxes only; a layout change with identical boxes (TP ``Shard(0)`` vs
    FSDP ``Shard(0)``) must also re-plan, or the catalog would describe the old layout."""
    if not _compare_save_plans(plan, cached):
        return False
    mine, theirs = plan.planner_data or {}, cached.planner_data or {}
    return all(mine.get(k) == theirs.get(k) for k in ("catalog", "mappings", "claims", "coordinator"))


def _writer_info() -> dict[str, str]:
    from . import __version__

    return {"ucp_dcp": __version__, "torch": torch.__version__.split("+")[0]}
