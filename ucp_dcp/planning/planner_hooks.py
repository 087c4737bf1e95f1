"""The planners' side of DCP's extension points (:mod:`ucp_dcp.planning.hooks`): mixins that
refuse unsupported overrides when a subclass is defined and run ucp_dcp's work around the
outermost call of a hook (``_outer_<hook>``), where an override cannot skip it."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from ..errors import UCPError
from ..layout.dtypes import check_range
from ..layout.fragments import Fragment
from ..options import protocol_error
from .catalog import CATALOG_KEY
from .forgotten_maps import map_reads
from .hooks import (
    LOAD_OUTER,
    REFUSED_LOAD,
    REFUSED_SAVE,
    SAVE_OUTER,
    as_written,
    check_unchanged,
    install,
    item_key,
    items_of,
    kept_reads,
    overrides,
    plan_snapshot,
    prune_resolved,
    reconcile_write_items,
    refuse_overrides,
)
from .payloads import ItemKind
from .resolve import Resolved
from .save_steps import tensor_item
from .tie_reads import TieReads

__all__ = ["SaveHooks", "LoadHooks"]

_SAVE_GLOBAL = (
    "drop items or change their dtype in create_local_plan (each rank's own items): the global plan (dedup, "
    "coverage, the catalog) is computed from them"
)
_LOAD_GLOBAL = (
    "drop read items in create_local_plan (each rank's own reads): the storage layer schedules the reads of "
    "every rank from the local plans"
)
_DATA_HOOKS = ("resolve_data", "lookup_object", "transform_object")


def _set_up_hooks(cls: type, outer: tuple[str, ...], refused: dict[str, str], name: str) -> None:
    base = next((c for c in cls.__mro__[1:] if "_hook_base" in c.__dict__), None)
    if base is None:
        cls._hook_base = cls  # type: ignore[attr-defined]  # the planner class itself
    else:
        refuse_overrides(cls, base, refused, name)
    install(cls, outer)


class SaveHooks:
    """``UCPSavePlanner``'s hook plumbing (a mixin; the state it reads is the planner's)."""

    _hook_base: type
    _offered: Any
    _resolved: list[Resolved]
    _final: list[Any]
    mappings: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _set_up_hooks(cls, SAVE_OUTER, REFUSED_SAVE, "UCPSavePlanner")

    def _item_edits(self, plan: SavePlan) -> set[tuple[str, tuple[int, ...] | None]]:
        """Take what an override of ``create_local_plan`` did to the items: atoms whose every item was
        dropped leave the plan (catalog and mappings included), retyped atoms get ``_dtypes``; returns
        the dropped pieces of atoms that keep others."""
        if plan.planner_data is not self.mappings:
            raise UCPError(
                "create_local_plan: the local plan's planner_data was replaced; UCPSavePlanner's plan travels there",
                hint="save per-rank data as a value of the state dict (it is versioned and resharded like the rest)",
            )
        dropped, dtypes = reconcile_write_items(self._offered, plan.items, "create_local_plan")
        kept = {item_key(it)[0] for it in plan.items}
        reduced = [a for r in self._resolved if r.reduce is not None for a in r.atoms if a in dtypes]
        if reduced:
            raise UCPError(
                f"create_local_plan: the dtype of the Reduce atom {reduced[0]!r} was changed; the coordinator "
                "writes its reduced value",
                atom=reduced[0],
                hint="convert the value in the state dict instead",
            )
        self._resolved, pieces = prune_resolved(self._resolved, dropped, kept)
        gone = {name for name, _ in dropped} - kept
        self.mappings = {a: p for a, p in self.mappings.items() if a not in gone}
        self._dtypes = dtypes
        return pieces

    def _unedited(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """The plans an override of ``create_global_plan`` passed on: it may read their items, not edit them."""
        offered = self.__dict__.pop("_global_offered", None)
        if offered is None:
            return all_plans
        for before, p in zip(offered, all_plans):
            check_unchanged(before, p.items, "create_global_plan", _SAVE_GLOBAL)
        return [replace(p, items=[]) for p in all_plans]

    def _outer_create_global_plan(self, call: Any, all_plans: list[SavePlan]) -> Any:
        if overrides(self, self._hook_base, "create_global_plan"):  # the override sees DCP's items
            all_plans = [replace(p, items=items_of(p.planner_data)) for p in all_plans]
            self._global_offered = [plan_snapshot(p.items) for p in all_plans]
        plans, metadata = call(all_plans)
        if not isinstance(metadata.planner_data, dict) or CATALOG_KEY not in metadata.planner_data:
            raise UCPError(
                "create_global_plan: the metadata's planner_data lost ucp_dcp's catalog",
                hint="keep metadata.planner_data a dict (DCP's flatten mappings live there too) and add your data "
                f"under a key of your own, leaving {CATALOG_KEY!r} in it",
            )
        if any(p.items for p in plans):
            raise UCPError("create_global_plan: items were added to the global plan", hint=_SAVE_GLOBAL)
        return plans, metadata

    def _outer_finish_plan(self, call: Any, new_plan: SavePlan) -> SavePlan:
        plan = call(new_plan)
        hint = "drop items or change their dtype in create_local_plan: the metadata already lists these"
        check_unchanged(self._final, plan.items, "finish_plan", hint)
        return plan

    def _outer_resolve_data(self, call: Any, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if not hasattr(self, "_local"):
            raise protocol_error("resolve_data", "create_local_plan() and finish_plan()")
        return as_written(write_item, call(write_item))

    def _copy_as_written(self, name: str, r: Resolved, f: Fragment) -> torch.Tensor:
        """This rank's copy of a replicated piece another rank writes, as the data hooks give it
        (the writer compares it with the written bytes)."""
        dtypes = getattr(self, "_dtypes", {})
        if not dtypes and not any(overrides(self, self._hook_base, h) for h in _DATA_HOOKS):
            return f.view(r.local).detach()
        shape, dtype = tuple(r.atoms[name]["shape"]), dtypes.get(name, r.local.dtype)
        item = tensor_item(name, f.box.offsets, f.box.sizes, shape, dtype, ItemKind.SHARD)
        data = self.resolve_data(item)  # type: ignore[attr-defined]
        assert isinstance(data, torch.Tensor)
        return data


class LoadHooks:
    """``UCPLoadPlanner``'s hook plumbing (a mixin; the state it reads is the planner's)."""

    _hook_base: type
    _reads: list[ReadItem]
    _payload: Any
    _final: list[Any]
    _targets: dict[str, Resolved]
    _scratch: dict[int, tuple[int, torch.Tensor, str]]
    _untouched: set[str]
    _catalog: Any
    _compared: dict[str, str]
    _ties: TieReads | None
    metadata: Any
    maps: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _set_up_hooks(cls, LOAD_OUTER, REFUSED_LOAD, "UCPLoadPlanner")

    def _outer_create_local_plan(self, call: Any) -> LoadPlan:
        """After the outermost ``create_local_plan``: the reads an override kept are the plan."""
        plan = call()
        if plan.planner_data is not self._payload:
            raise UCPError(
                "create_local_plan: the local plan's planner_data was replaced; UCPLoadPlanner's plan travels there",
                hint="keep the planner_data super().create_local_plan() returned",
            )
        if [id(it) for it in plan.items] == [id(it) for it in self._reads]:
            return plan
        kept = kept_reads(self._reads, plan.items, "create_local_plan")
        self._untouched = {it.dest_index.fqn for it in self._reads} - {it.dest_index.fqn for it in kept}
        self._reads = kept
        payload = replace(self._payload, map_reads=map_reads(self._catalog, self.maps, kept))
        return LoadPlan(kept, storage_data=plan.storage_data, planner_data=payload)

    def _check_unedited(self, global_plan: list[LoadPlan]) -> None:
        offered = self.__dict__.pop("_global_offered", None)
        for before, p in zip(offered or (), global_plan):  # an override may read the items, not edit them
            check_unchanged(before, p.items, "create_global_plan", _LOAD_GLOBAL)

    def _outer_create_global_plan(self, call: Any, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        self._global_offered = [plan_snapshot(p.items) for p in global_plan]
        plans = call(global_plan)
        if any(p.items for p in plans):
            raise UCPError("create_global_plan: items were added to the global plan", hint=_LOAD_GLOBAL)
        return plans

    def _outer_finish_plan(self, call: Any, new_plan: LoadPlan) -> LoadPlan:
        plan = call(new_plan)
        check_unchanged(self._final, plan.items, "finish_plan", _LOAD_GLOBAL)
        # tied keys whose saved copies are compared when read: counted from the final reads
        compared = self.__dict__.get("_compared")
        self._ties = TieReads(compared, self._targets, self._reads, self.metadata) if compared else None
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The memory of target ``index.fqn`` that fragment ``index.index`` occupies (the local
        tensor for a key of one atom, as DCP's lookup returns a DTensor's local tensor)."""
        r = self._targets[index.fqn]
        return r.fragments[index.index or 0].view(r.local)

    def _scratch_for(self, read_item: ReadItem, target: torch.Tensor, saved: torch.dtype) -> torch.Tensor:
        """A tensor of the saved dtype to read into; ``_outer_commit_tensor`` converts it into ``target``."""
        atom = self._targets[read_item.dest_index.fqn].fragments[read_item.dest_index.index or 0].atom
        scratch = torch.empty(tuple(read_item.lengths), dtype=saved)
        # by storage address: the reader may hand back a detached alias of it
        self._scratch[id(read_item)] = (scratch.untyped_storage().data_ptr(), target, atom)
        return scratch

    def _tie_read(self, read_item: ReadItem, target: torch.Tensor) -> torch.Tensor:
        """What ``resolve_tensor`` hands the reader: ``target``, or for a key of a tied tensor whose saved
        copies are compared when read (:mod:`ucp_dcp.planning.tie_reads`) scratch memory of the saved dtype
        (``target`` gets the value once the copies compare equal)."""
        ties = self.__dict__.get("_ties")
        return target if ties is None or not ties.holds(read_item) else ties.scratch(read_item, target)

    def _outer_commit_tensor(self, call: Any, read_item: ReadItem, tensor: torch.Tensor) -> None:
        ties = self.__dict__.get("_ties")
        if ties is not None and ties.holds(read_item):
            # a copy of a tied tensor: committed (every read of its fragment, each into what resolve_tensor
            # would have returned) once all copies arrived and compared equal
            for item, dest in ties.arrive(read_item, tensor):
                self._commit_read(call, item, dest)
            return None
        return self._commit_read(call, read_item, tensor)

    def _commit_read(self, call: Any, read_item: ReadItem, tensor: torch.Tensor) -> None:
        # a scratch of resolve_tensor is converted into its target here, where no override skips it,
        # and the override is given the target (what DCP's commit_tensor receives)
        scratch = self._scratch.pop(id(read_item), None) if hasattr(self, "_scratch") else None
        if scratch is None:
            return call(read_item, tensor)
        ptr, target, atom = scratch
        if tensor.untyped_storage().data_ptr() != ptr:
            # an override of resolve_tensor read into a tensor of its own, built from the scratch (another
            # dtype than DCP's destination) and past the range check
            raise UCPError(
                f"atom '{atom}': saved dtype {tensor.dtype}, target dtype {target.dtype}: a narrowing conversion is "
                f"read into a scratch tensor of the saved dtype and range-checked; the override of resolve_tensor "
                f"({type(self).__name__}) returned another tensor, which would skip both",
                atom=atom,
                saved=tensor.dtype,
                wanted=target.dtype,
                hint="pass allow_lossy_dtype=True (super().resolve_tensor then returns the destination and the "
                "reader converts as Tensor.copy_ does, as DCP's), or load into a target of the saved dtype",
            )
        if tensor.dtype != target.dtype:
            check_range(atom, tensor, target.dtype)
        with torch.no_grad():
            target.copy_(tensor)
        return call(read_item, target)
