"""What :class:`~ucp_dcp.peers.torch_checkpointing.UCPResharder` records at save for each leaf of a
torch_checkpointing item: the leaf's atoms and, for a tensor, its fragments (box in the atom, place in
local memory) -- the same resolution ``ucp_dcp.save`` runs (name rules, stage and expert maps, ``Fused``,
``Padded``, ``Tied``, ``Reduce``), kept as builtins so torch_checkpointing's JSON metadata carries them.

Pure: no process group, no torch_checkpointing import (the registered metadata class lives in the
resharder's module, which imports this one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..layout.fragments import Box, Fragment
from ..layout.naming import NameRules, OptimizerForm, find_optimizer_containers
from ..planning.entries import GroupTarget, is_sharded
from ..planning.resolve import Resolved, Resolver

__all__ = ["LeafKind", "LeafRecord", "FragmentRecord", "record_leaves", "group_paths", "leaf_at"]

LeafKind = Literal["tensor", "object", "hyperparam"]
"""``tensor``: fragments of atoms; ``object``: one atom saved whole (a counter, a step, a flat
optimizer's hyperparameter); ``hyperparam``: a nested optimizer group's value, one atom per parameter."""

NestedPath = tuple[Any, ...]


@dataclass(frozen=True)
class FragmentRecord:
    """One :class:`~ucp_dcp.layout.fragments.Fragment` as builtins."""

    atom: str
    """The atom the piece belongs to."""
    offsets: tuple[int, ...]
    """The piece's box in the atom: start per dim."""
    sizes: tuple[int, ...]
    """The piece's box in the atom: extent per dim."""
    local_offsets: tuple[int, ...]
    """Where the piece sits in the (optionally reshaped) local tensor: start per dim."""
    local_sizes: tuple[int, ...]
    """... and extent per dim."""
    view_shape: tuple[int, ...] | None
    """Reshape of the local tensor before the cut (``Fused``), None: none."""

    @classmethod
    def of(cls, f: Fragment) -> FragmentRecord:
        return cls(f.atom, f.box.offsets, f.box.sizes, f.local.offsets, f.local.sizes, f.view_shape)

    def fragment(self) -> Fragment:
        return Fragment(
            self.atom, Box(self.offsets, self.sizes), Box(self.local_offsets, self.local_sizes), self.view_shape
        )


@dataclass(frozen=True)
class LeafRecord:
    """One leaf of an item on one saving rank."""

    kind: LeafKind
    """What the leaf is (see :data:`LeafKind`)."""
    atoms: tuple[tuple[str, tuple[int, ...], str], ...]
    """``(atom, logical shape, dtype name)`` per atom the leaf holds (objects: shape ``()``, dtype ``""``)."""
    fragments: tuple[FragmentRecord, ...] = ()
    """Tensor leaves: the pieces of local memory, each a box of one atom."""
    data_slot: int | None = None
    """The saving rank's data slot (``Reduce`` atoms: copies within a slot count once)."""
    plain: bool = False
    """A plain tensor (not a DTensor): its copies on several ranks are one value only if they agree."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "atoms": [[a, list(s), d] for a, s, d in self.atoms],
            "fragments": [
                [
                    f.atom,
                    list(f.offsets),
                    list(f.sizes),
                    list(f.local_offsets),
                    list(f.local_sizes),
                    f.view_shape and list(f.view_shape),
                ]
                for f in self.fragments
            ],
            "data_slot": self.data_slot,
            "plain": self.plain,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LeafRecord:
        return cls(
            kind=d["kind"],
            atoms=tuple((str(a), tuple(int(x) for x in s), str(t)) for a, s, t in d["atoms"]),
            fragments=tuple(
                FragmentRecord(str(a), tuple(o), tuple(s), tuple(lo), tuple(ls), tuple(v) if v is not None else None)
                for a, o, s, lo, ls, v in d["fragments"]
            ),
            data_slot=d.get("data_slot"),
            plain=bool(d.get("plain", False)),
        )


def leaf_at(root: Any, path: NestedPath) -> Any:
    """The value at ``path`` in nested dicts and lists; dict keys match by their printed form (DCP
    and JSON turn them into strings)."""
    node = root
    for seg in path:
        if isinstance(node, Mapping):
            node = node[seg] if seg in node else node[next(k for k in node if str(k) == str(seg))]
        else:
            node = node[int(seg)]
    return node


def group_paths(state_dict: Mapping[str, Any], names: NameRules) -> list[NestedPath]:
    """The raw path of each nested optimizer param group, in the order ``collect_entries`` returns
    its :class:`~ucp_dcp.planning.entries.GroupTarget`\\ s."""
    out: list[NestedPath] = []
    for cpath, form in find_optimizer_containers(state_dict).items():
        if form == OptimizerForm.NESTED:
            out += [(*cpath, "param_groups", i) for i in range(len(leaf_at(state_dict, cpath)["param_groups"]))]
    return out


def _tensor_record(r: Resolved, data_slot: int | None) -> LeafRecord:
    atoms = tuple((a, tuple(rec["shape"]), str(rec["dtype"])) for a, rec in r.atoms.items())
    frags = tuple(FragmentRecord.of(f) for f in r.fragments)
    return LeafRecord("tensor", atoms, frags, data_slot, plain=not is_sharded(r.value))


def record_leaves(resolver: Resolver, item_key: str, value: Any, data_slot: int | None) -> dict[NestedPath, LeafRecord]:
    """Every leaf of item ``item_key`` resolved to atoms: NestedPath (within the item) -> record.
    Leaves of ranks outside a value's mesh, and group membership lists, get none."""
    root = {item_key: value}
    resolved, groups = resolver.resolve_state_dict(root, for_load=True)
    out: dict[NestedPath, LeafRecord] = {}
    for r in resolved:
        if not r.present:
            continue
        path = tuple(r.entry.path[1:])
        if r.entry.is_tensor and r.reduce is None:
            out[path] = _tensor_record(r, data_slot)
        else:
            out[path] = LeafRecord("object", ((r.name, (), ""),), (), data_slot)
    for g, gpath in zip(groups, group_paths(root, resolver.names), strict=True):
        out.update(_group_records(g, gpath, data_slot))
    return out


def _group_records(g: GroupTarget, gpath: NestedPath, data_slot: int | None) -> dict[NestedPath, LeafRecord]:
    return {
        (*gpath[1:], hp): LeafRecord("hyperparam", tuple((g.atom(p, hp), (), "") for p in g.params), (), data_slot)
        for hp in g.hyperparams
    }
