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
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..errors import UCPError, this_rank
from .payloads import ItemKind, dtype_of
from .resolve import Resolved
from .save_steps import tensor_item, write_rows

__all__ = [
    "SAVE_OUTER",
    "LOAD_OUTER",
    "REFUSED_SAVE",
    "REFUSED_LOAD",
    "install",
    "overrides",
    "refuse_overrides",
    "state_view",
    "check_state_dict",
    "reconcile_write_items",
    "prune_resolved",
    "offered_items",
    "items_of",
    "snapshot",
    "as_written",
    "kept_reads",
    "check_resolved",
    "check_unchanged",
    "plan_snapshot",
    "item_key",
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
