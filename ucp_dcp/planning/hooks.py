"""DCP's planner extension points on top of atoms (issue 31).

A subclass of ``UCPSavePlanner``/``UCPLoadPlanner`` overrides DCP's hooks the way DCP's docs
subclass the default planners. The planners keep DCP's call structure (``resolve_data`` is
``lookup_object`` + ``transform_object``, ``resolve_tensor`` is ``lookup_tensor`` +
``transform_tensor``, local plans hold their items); what ucp_dcp must do *after* an override ran
(pack the items the override kept, convert a scratch tensor into its target before a
``commit_tensor`` that skips ``super()``) runs in a wrapper around the outermost call of the hook
(:func:`install`), so an override cannot skip it. Hooks that cannot keep their meaning are refused
when the subclass is defined (:func:`refuse_overrides`), and edits a hook cannot carry are refused
when they happen, naming the hook and what to do instead: never ignored.
"""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType

from ..errors import UCPError, this_rank
from ..layout.dtypes import check_range
from ..layout.fragments import Fragment
from ..options import protocol_error
from .catalog import CATALOG_KEY
from .load_steps import TieReads, map_reads
from .payloads import ItemKind, dtype_of
from .resolve import Resolved
from .save_steps import tensor_item, write_rows

__all__ = [
    "LOAD_OUTER",
    "LoadHooks",
    "REFUSED_LOAD",
    "REFUSED_SAVE",
    "SAVE_OUTER",
    "SaveHooks",
    "as_written",
    "check_resolved",
    "check_state_dict",
    "check_unchanged",
    "install",
    "item_key",
    "items_of",
    "kept_reads",
    "offered_items",
    "overrides",
    "plan_snapshot",
    "prune_resolved",
    "reconcile_write_items",
    "refuse_overrides",
    "snapshot",
    "state_view",
]

SAVE_OUTER = ("create_local_plan", "create_global_plan", "finish_plan", "resolve_data")
"""Save hooks with work before/after the outermost call (``_outer_<name>`` on the planner)."""
LOAD_OUTER = ("create_local_plan", "create_global_plan", "finish_plan", "commit_tensor")
"""Load hooks with work before/after the outermost call."""

REFUSED_SAVE = {
    name: "UCPSavePlanner plans the global step from packed atom arrays and never calls DCP's private "
    f"{name}; override create_global_plan / finish_plan (public, honoured) instead"
    for name in (
        "_dedup_save_plans",
        "_create_global_plan",
        "_create_global_plan_with_caching",
        "_finish_plan_with_caching",
    )
}
"""DCP-private save methods ours never calls: an override would be ignored, so it is refused."""
REFUSED_LOAD = {
    "resolve_bytes": "no storage reader calls resolve_bytes (DCP's FileSystemReader does not either); "
    "override load_bytes, which receives every non-tensor value",
}
"""Load methods no reader calls: refused rather than silently ignored."""

_depth = threading.local()


def _outermost(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (one class's ``name``), run through the planner's ``_outer_<name>`` when no other
    ``name`` of this planner is running on this thread (an override's ``super()`` call is inner)."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        running = _depth.__dict__.setdefault("running", set())
        key = (id(self), name)
        if key in running:
            return fn(self, *args, **kwargs)
        running.add(key)
        try:
            return getattr(self, f"_outer_{name}")(functools.partial(fn, self), *args, **kwargs)
        except UCPError as e:
            if name == "create_global_plan":  # DCP hands it to every rank as the coordinator's failure
                e.collective, e.found_by = True, this_rank()
            raise
        finally:
            running.discard(key)

    wrapper.__ucp_outermost__ = True  # type: ignore[attr-defined]
    return wrapper


def install(cls: type, names: Iterable[str]) -> None:
    """Wrap each hook ``cls`` resolves to that is not wrapped yet: DCP's inherited ones on the planner
    class, each subclass's overrides, also those it gets from a mixin listed before the planner."""
    for name in names:
        fn = getattr(cls, name, None)
        if callable(fn) and not getattr(fn, "__ucp_outermost__", False):
            setattr(cls, name, _outermost(name, fn))


def overrides(planner: Any, base: type, name: str) -> bool:
    """Whether ``planner``'s class replaces ``base``'s ``name``."""
    return getattr(type(planner), name) is not getattr(base, name)


def refuse_overrides(cls: type, base: type, refused: dict[str, str], planner: str) -> None:
    """Raise at class definition when ``cls`` replaces a hook of ``base`` that ``planner`` would never call."""
    for name, why in refused.items():
        if getattr(cls, name, None) is not getattr(base, name, None):
            raise UCPError(f"{cls.__qualname__}.{name}: {planner} does not support overriding {name}: {why}", hint=why)


# -- set_up_planner ------------------------------------------------------------------------------


def state_view(state_dict: dict[str, Any]) -> dict[str, int]:
    """What ``set_up_planner`` planned from: key -> identity of the value."""
    return {k: id(v) for k, v in state_dict.items()}


def check_state_dict(planner: Any, planner_name: str) -> None:
    """Refuse a ``set_up_planner`` override that skipped ``super()`` or edited ``self.state_dict``
    after it: ucp_dcp resolves the state dict into atoms inside ``set_up_planner``."""
    view = planner.__dict__.get("_state_view")
    if view is None:
        if "state_dict" in planner.__dict__:
            raise UCPError(
                f"set_up_planner of {type(planner).__name__} did not call super().set_up_planner(): "
                f"{planner_name} resolves the state dict into atoms there",
                hint="edit or rename the state dict, then pass it to super().set_up_planner(state_dict, ...)",
            )
        return
    if state_view(planner.state_dict) != view:
        changed = sorted(set(view) ^ set(planner.state_dict)) or sorted(
            k for k, v in planner.state_dict.items() if id(v) != view.get(k)
        )
        raise UCPError(
            f"self.state_dict was changed after {planner_name}.set_up_planner resolved it (keys {changed[:5]}): "
            "the change would not be planned",
            hint="edit the state dict before calling super().set_up_planner(state_dict, ...)",
        )


# -- save: the local plan's items -------------------------------------------------------------------


def item_key(item: WriteItem) -> tuple[str, tuple[int, ...] | None]:
    """An item's identity within a rank's plan: atom and chunk offsets."""
    off = item.index.offset
    return item.index.fqn, tuple(off) if off is not None else None


def _write_shape(item: WriteItem) -> tuple[Any, ...]:
    """Everything of an item but its dtype (a hook may change the dtype only)."""
    td = item.tensor_data
    if td is None:
        return (item.type,)
    p = td.properties
    return (item.type, tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size), p.layout, p.memory_format)


def _dtype(item: WriteItem) -> torch.dtype | None:
    return item.tensor_data.properties.dtype if item.tensor_data is not None else None


def snapshot(items: Sequence[WriteItem]) -> dict[tuple[str, tuple[int, ...] | None], tuple[Any, torch.dtype | None]]:
    """The items as values (a hook may mutate the objects: DCP's FP16 example sets the dtype in place)."""
    return {item_key(it): (_write_shape(it), _dtype(it)) for it in items}


def reconcile_write_items(
    offered: dict[tuple[str, tuple[int, ...] | None], tuple[Any, torch.dtype | None]],
    returned: Sequence[WriteItem],
    hook: str,
) -> tuple[set[tuple[str, tuple[int, ...] | None]], dict[str, torch.dtype]]:
    """What a ``create_local_plan`` override did to the items it was offered: the dropped item keys
    and the atoms whose dtype it changed. Added, duplicated or reshaped items are refused."""
    seen: set[tuple[str, tuple[int, ...] | None]] = set()
    dtypes: dict[str, set[torch.dtype | None]] = {}
    for it in returned:
        key = item_key(it)
        if key in seen or key not in offered:
            what = "returned twice" if key in seen else "added"
            raise UCPError(
                f"{hook}: item {key[0]!r} (offsets {key[1]}) was {what}; UCPSavePlanner writes the atoms "
                "of the state dict given to set_up_planner",
                atom=key[0],
                hint="add the value to the state dict (before super().set_up_planner) instead of adding an item",
            )
        seen.add(key)
        shape, dtype = offered[key]
        if _write_shape(it) != shape:
            raise UCPError(
                f"{hook}: item {key[0]!r} (offsets {key[1]}) was changed (type, chunk or size); only its dtype "
                "may change: the atom's layout comes from the value itself",
                atom=key[0],
                hint="reshape or slice the value in the state dict before super().set_up_planner",
            )
        if _dtype(it) != dtype:
            dtypes.setdefault(key[0], set()).add(_dtype(it))
    changed: dict[str, torch.dtype] = {}
    for name, ds in dtypes.items():
        pieces = {k for k in offered if k[0] == name and k in seen}
        if len(ds) != 1 or any(_dtype(it) not in ds for it in returned if item_key(it) in pieces):
            raise UCPError(
                f"{hook}: the pieces of {name!r} were given different dtypes; one atom has one dtype",
                atom=name,
                hint="give every item of the atom the same tensor_data.properties.dtype",
            )
        (changed[name],) = ds  # type: ignore[assignment]
    return set(offered) - seen, changed


def offered_items(resolved: Sequence[Resolved]) -> list[WriteItem]:
    """The local plan's items, as DCP's ``create_local_plan`` lists them: one per piece of local
    memory (a fragment of an atom) or object; a ``Reduce`` atom as one whole item."""
    out: list[WriteItem] = []
    for r in resolved:
        tensor = isinstance(r.value, torch.Tensor)
        if r.reduce is not None:
            for name, rec in r.atoms.items():
                shape = tuple(rec["shape"]) if tensor else None
                out.append(
                    tensor_item(name, (0,) * len(shape), shape, shape, r.value.dtype, ItemKind.TENSOR)
                    if shape is not None
                    else WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
                )
            continue
        for name, kind, offsets, sizes, _ in write_rows(r):
            if not tensor:
                out.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
                continue
            shape = tuple(r.atoms[name]["shape"])
            out.append(tensor_item(name, offsets, sizes, shape, r.local.dtype, kind))
    return out


def items_of(payload: Any) -> list[WriteItem]:
    """A gathered local plan's items, unpacked for an override of ``create_global_plan`` (none for a
    rank that sent no plan: unchanged under plan caching, as in DCP; or not a ucp_dcp plan)."""
    packed = getattr(payload, "packed", None)
    if packed is None:
        return []
    structure, items = packed.unpack_structure(), packed.unpack_items()
    out = []
    for i in range(len(items.atom)):
        a, kind = int(items.atom[i]), ItemKind(int(items.kind[i]))
        name, shape = structure.names[a], structure.shapes[a]
        if kind == ItemKind.BYTES:
            out.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
            continue
        nd = len(shape)
        offsets, sizes = items.off[i, :nd].tolist(), items.size[i, :nd].tolist()
        out.append(tensor_item(name, offsets, sizes, shape, dtype_of(structure.dtypes[a]), kind))
    return out


def prune_resolved(
    resolved: list[Resolved], dropped: set[tuple[str, tuple[int, ...] | None]], kept_keys: set[str]
) -> tuple[list[Resolved], set[tuple[str, tuple[int, ...] | None]]]:
    """The entries without the atoms whose every item was dropped (they leave the local plan, catalog
    included), and the dropped pieces of atoms that keep some (their rows are left out)."""
    if not dropped:
        return resolved, set()
    gone = {name for name, _ in dropped} - kept_keys
    out = []
    for r in resolved:
        if not gone.intersection(r.atoms):
            out.append(r)
            continue
        atoms = {a: rec for a, rec in r.atoms.items() if a not in gone}
        if atoms:
            out.append(
                replace(
                    r,
                    atoms=atoms,
                    paths={a: p for a, p in r.paths.items() if a not in gone},
                    fragments=[f for f in r.fragments if f.atom not in gone],
                )
            )
    return out, {d for d in dropped if d[0] not in gone}


def as_written(item: WriteItem, data: Any) -> torch.Tensor | io.BytesIO:
    """``resolve_data``'s result as the storage layer writes it: an object as a ``BytesIO``; a
    tensor in the dtype its item declares (DCP stores what it is given and converts at load; the
    loaded values are the same) and of the item's size, else the hooks broke the item."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise UCPError(
                f"resolve_data returned {type(data).__name__} for the object item {item.index.fqn!r}, not io.BytesIO",
                atom=item.index.fqn,
                hint="let transform_object serialize it (super().transform_object), as DCP's does",
            )
        return data
    td = item.tensor_data
    if not isinstance(data, torch.Tensor) or td is None or tuple(data.shape) != tuple(td.chunk.sizes):
        got = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise UCPError(
            f"the data of {item.index.fqn!r} (offsets {tuple(item.index.offset or ())}) is {got}, not a tensor "
            f"of the item's size {tuple(td.chunk.sizes) if td else None}",
            atom=item.index.fqn,
            saved=str(got),
            hint="lookup_object is given the atom's index (index.fqn is the atom name, index.offset the piece); "
            "return the piece it names (super().lookup_object(index) does), as DCP's lookup_object returns shards",
        )
    return data if data.dtype == td.properties.dtype else data.to(td.properties.dtype)


# -- load -----------------------------------------------------------------------------------------


def _read_key(item: ReadItem) -> tuple[Any, ...]:
    return (
        item.type,
        item.dest_index.fqn,
        item.dest_index.index,
        tuple(item.dest_offsets),
        item.storage_index.fqn,
        tuple(item.storage_index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def check_resolved(target: torch.Tensor, read_item: ReadItem) -> None:
    """``lookup_tensor`` + ``transform_tensor`` must give the item's box (the reader writes its bytes there)."""
    if tuple(target.shape) != tuple(read_item.lengths):
        raise UCPError(
            f"lookup_tensor/transform_tensor gave {tuple(target.shape)} for a read of {tuple(read_item.lengths)} "
            f"into {read_item.dest_index.fqn!r}",
            hint="lookup_tensor returns the tensor of dest_index (its fqn is the flattened key) and "
            "transform_tensor narrows it to the item's box (super().transform_tensor does)",
        )


def kept_reads(offered: Sequence[ReadItem], returned: Sequence[ReadItem], hook: str) -> list[ReadItem]:
    """The offered reads a ``create_local_plan`` override kept (dropping is honoured: the target
    keeps its value); added or changed reads are refused."""
    by_key = {_read_key(it): it for it in offered}
    out = []
    for it in returned:
        mine = by_key.pop(_read_key(it), None)
        if mine is None:
            raise UCPError(
                f"{hook}: read item for {it.dest_index.fqn!r} (from {it.storage_index.fqn!r}) was added, repeated "
                "or changed; UCPLoadPlanner plans the reads of each target from the checkpoint's atoms",
                atom=it.storage_index.fqn,
                hint="drop read items to leave a target as it is; redirect the data with lookup_tensor / "
                "transform_tensor / commit_tensor, or rename keys before super().set_up_planner",
            )
        out.append(mine)
    return out


def plan_snapshot(items: Sequence[Any]) -> list[Any]:
    """Plan items as values, taken when the planner made them (a later hook may mutate them in place)."""
    return [_read_key(it) if isinstance(it, ReadItem) else (item_key(it), _write_shape(it), _dtype(it)) for it in items]


def check_unchanged(before: list[Any], after: Sequence[Any], hook: str, hint: str) -> None:
    """Refuse an override that edited items where ucp_dcp cannot carry the edit (the global plan,
    ``finish_plan``): the checkpoint's metadata or the other ranks already count on them."""
    if before != plan_snapshot(after):
        raise UCPError(
            f"{hook} changed the plan's items ({len(before)} -> {len(after)} items); they are fixed at this step",
            hint=hint,
        )


# -- the planners' hook mixins: work around the outermost call of a hook ---------------------------------------------
# The planners' side of DCP's extension points (above): mixins that
# refuse unsupported overrides when a subclass is defined and run ucp_dcp's work around the
# outermost call of a hook (``_outer_<hook>``), where an override cannot skip it.


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
        copies are compared when read (:mod:`ucp_dcp.planning.load_steps`) scratch memory of the saved dtype
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
