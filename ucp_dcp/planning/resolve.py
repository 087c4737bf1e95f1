"""Resolve live state-dict entries into atoms and fragments, applying maps and pattern rules.

The same resolution runs at save (fragments are what a rank writes) and at load (fragments are
what a rank must fill), so any layout the rules can describe round-trips through atoms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, is_checkpointable_tensor
from ..errors import PatternError
from ..layout.fragments import (
    Box,
    Fragment,
    LocalShards,
    boxes_fragments,
    clip_padding,
    fused_block_problem,
    fused_segments,
    layout_fragments,
    shard_fragments,
    split_fused,
    whole_fragment,
)
from ..layout.index_maps import IndexMap
from ..layout.naming import AtomName, NameRules, Path
from ..layout.patterns import Fused, Padded, Patterns, Reduce, Replicated, Tied, describe
from ..layout.placements import (
    Layout,
    checkpointable_shards,
    dtensor_coordinate,
    dtype_name,
    global_shape,
    mesh_info,
    sharded_tensor_record,
    sharded_tensor_shards,
)
from .entries import Entry, GroupTarget, collect_entries, local_tensor, shard_memory

__all__ = ["Resolved", "Resolver"]


@dataclass
class Resolved:
    """One live entry, resolved."""

    entry: Entry
    """The live state-dict entry."""
    atom: AtomName
    """Its canonical name after renumbering and tie resolution (before fused splitting)."""
    atoms: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Atoms this entry produces or consumes -> catalog record."""
    paths: dict[str, Path] = field(default_factory=dict)
    """Atom name -> canonical DCP path (for the flatten mappings)."""
    fragments: list[Fragment] = field(default_factory=list)
    """Pieces of local memory, each labelled with its atom (tensor entries)."""
    fills: list[Box] = field(default_factory=list)
    """Local boxes backed by no atom (padding); filled with ``fill_value`` at load."""
    fill_value: float = 0.0
    """Value for ``fills``."""
    padding_rule: Padded | None = None
    """The ``Padded`` rule that cut ``fills`` off (a save checks they hold only ``fill_value``)."""
    fanout: bool = False
    """A scalar/object under a fused parameter: the same value belongs to every part atom."""
    present: bool = True
    """False when this rank is not part of the value's mesh (nothing to save or load here)."""
    tied: bool = False
    """The entry is one copy of a tied parameter."""
    replicated: Replicated | None = None
    """Replicated rule matching the parameter."""
    reduce: Reduce | None = None
    """Reduce rule matching the atom."""
    index_claims: list[tuple[str, int, int | None]] = field(default_factory=list)
    """``(map key, global index, owner)`` claimed by this entry (ownership checks)."""
    unsplit: list[Fragment] | None = None
    """Fused entries with a layout-invariant block count (``blocks=<int>``): the fragments of the
    live tensor itself, so a checkpoint that stored it fused (stock DCP) still loads."""
    memory: torch.Tensor | LocalShards | None = None
    """The local memory, when resolving found it (a ShardedTensor's shards); else derived from the value."""

    @property
    def name(self) -> str:
        return self.atom.name

    @property
    def value(self) -> Any:
        return self.entry.value

    @property
    def local(self) -> torch.Tensor | LocalShards:
        """What the fragments view: one tensor, or a ShardedTensor's several local shards."""
        return self.memory if self.memory is not None else local_tensor(self.entry.value)


class Resolver:
    """Applies name rules, index maps and pattern rules to state-dict entries."""

    def __init__(self, names: NameRules, patterns: Patterns, maps: Sequence[IndexMap]) -> None:
        self.names = names
        self.patterns = patterns
        self.maps = tuple(maps)
        keys = [m.key for m in self.maps]
        if len(set(keys)) != len(keys):
            raise PatternError(f"two index maps renumber the same key: {keys}")
        self.used_maps: set[str] = set()

    def rewrite(self, path: Path) -> Path:
        for m in self.maps:
            path, _ = m.rewrite(path)
        return path

    def _claims(self, path: Path) -> list[tuple[str, int, int | None]]:
        out = []
        for m in self.maps:
            new, g = m.rewrite(path)
            if g is not None:
                out.append((m.key, g, m.owner_of(path)))
                self.used_maps.add(m.key)
            path = new
        return out

    def resolve_state_dict(
        self, state_dict: Mapping[str, Any], *, for_load: bool
    ) -> tuple[list[Resolved], list[GroupTarget]]:
        entries, groups = collect_entries(state_dict, self.names, for_load=for_load, rewrite=self.rewrite)
        out = []
        for e in entries:
            r = self.resolve(e)
            r.index_claims = self._claims(self.names.canonical_path(e.path))
            out.append(r)
        return out, groups

    def resolve(self, e: Entry) -> Resolved:
        tied_name = self.patterns.tie(e.atom.param)
        atom = e.atom.renamed(tied_name)
        r = Resolved(e, atom, tied=tied_name != e.atom.param or self._is_tied_target(e.atom.param))
        r.replicated = self.patterns.replicated(atom.param)
        r.reduce = self.patterns.reduce(atom.name)
        hit = self.patterns.tensor_rule(atom.param)
        rule, match = hit if hit else (None, None)
        checkpointable = is_checkpointable_tensor(e.value)
        if r.reduce is not None and (isinstance(e.value, (DTensor, ShardedTensor)) or checkpointable):
            raise PatternError(
                f"reduce rule {describe(r.reduce)} matches '{atom.name}', a {type(e.value).__name__}; reductions "
                "are for per-rank plain values",
                atom=atom.name,
                hint="narrow the pattern to plain per-rank values",
            )
        if not isinstance(e.value, torch.Tensor):
            return self._resolve_object(r, rule, match)
        value: torch.Tensor = e.value
        shape = global_shape(value)
        sharded = None
        if isinstance(value, DTensor):
            coord = dtensor_coordinate(value)
            if coord is None:
                r.present = False
                return r
            layout = Layout.from_dtensor(value)
            rec_layout = {"mesh": mesh_info(value).to_json(), "placements": layout.encode_placements()}
        else:
            coord, layout, rec_layout = (), Layout.replicated(), None
        if isinstance(value, ShardedTensor):
            # the shard plan states the boxes: each local shard is one fragment of the atom, through
            # the same checks, dedup and reads as a DTensor's pieces
            shards = sharded_tensor_shards(value, atom.name)
            r.memory = shard_memory(value, shards)
            base = shard_fragments(atom.name, [(s.offsets, s.sizes) for s in shards], indexed=len(shards) != 1)
            sharded = sharded_tensor_record(value)
        elif checkpointable:
            # torch >= 2.14's CheckpointableTensor: a plain tensor stating its boxes of a global tensor
            # (several, with padding between, in one local tensor): each is one fragment of the atom
            base = boxes_fragments(
                atom.name,
                [(c.global_offsets, c.local_offsets, c.sizes) for c in checkpointable_shards(value, atom.name)],
            )
        else:
            base = layout_fragments(atom.name, shape, layout, coord) if math.prod(shape) else []
        pattern = (
            "dtensor"
            if rec_layout
            else "sharded_tensor"
            if sharded
            else "checkpointable"
            if checkpointable
            else "plain"
        )
        rec = {
            "value": "tensor",
            "shape": list(shape),
            "dtype": dtype_name(r.local.dtype),
            "kind": atom.kind,
            "param": atom.param,
            "pattern": pattern,
        }
        if rec_layout:
            rec["layout"] = rec_layout
        if sharded:
            rec["sharded_tensor"] = sharded
        if r.tied and e.atom.param != atom.param:
            rec["live"] = e.atom.param
        if r.reduce is not None:
            rec["pattern"] = f"reduce:{r.reduce.op}"
        if rule is not None and checkpointable:  # its boxes are stated by the tensor, not derived by a rule
            raise PatternError(
                f"rule {describe(rule)} matches '{atom.name}', a CheckpointableTensor; pattern rules apply to "
                "DTensors, ShardedTensors and plain tensors",
                atom=atom.name,
                hint="narrow the rule's pattern, or state the tensor's pieces as separate atoms",
            )
        if rule is None or value.ndim <= rule.dim:
            if isinstance(rule, Fused):  # a scalar (e.g. `step`) of a fused parameter: one per part
                return self._fanout(r, rule, match, rec, value, base)
            r.atoms[atom.name] = rec
            r.paths[atom.name] = atom.path
            r.fragments = base
            return r
        if isinstance(r.local, LocalShards):  # the rule's transforms cut one local tensor
            raise PatternError(
                f"rule {describe(rule)} matches '{atom.name}', a ShardedTensor with {len(r.local)} local shards "
                "on this rank; pattern rules apply to a value whose local memory is one tensor",
                atom=atom.name,
                hint="shard the value with one local shard per rank (ChunkShardingSpec, FSDP1)",
            )
        if isinstance(rule, Padded):
            return self._padded(r, rule, rec, shape, base)
        return self._fused(r, rule, match, rec, shape, base, layout)

    def _is_tied_target(self, param: str) -> bool:
        return any(isinstance(rule, Tied) and rule.param == param for rule in self.patterns.rules)

    def _resolve_object(self, r: Resolved, rule, match) -> Resolved:
        rec = {"value": "object", "kind": r.atom.kind, "param": r.atom.param, "pattern": "object"}
        if r.reduce is not None:
            rec["pattern"] = f"reduce:{r.reduce.op}"
        if isinstance(rule, Fused):
            return self._fanout(r, rule, match, rec, None)
        r.atoms[r.name] = rec
        r.paths[r.name] = r.atom.path
        return r

    def _rule_index(self, rule) -> int:
        return self.patterns.rules.index(rule)

    def _fanout(
        self,
        r: Resolved,
        rule: Fused,
        match,
        rec: dict[str, Any],
        value: torch.Tensor | None,
        base: list[Fragment] | None = None,
    ) -> Resolved:
        r.fanout = True
        if isinstance(value, ShardedTensor):  # its pieces, each belonging to every part
            pieces = list(base or [])
        else:
            pieces = [whole_fragment(r.name, value.shape)] if value is not None and value.numel() else []
        if isinstance(rule.blocks, int):
            r.unsplit = pieces
        for tmpl, _ in rule.parts:
            part = r.atom.renamed(self.patterns.expand(match, tmpl))
            r.atoms[part.name] = {
                **rec,
                "param": part.param,
                "pattern": "fused",
                "live": r.atom.param,
                "rule": self._rule_index(rule),
            }
            r.paths[part.name] = part.path
            r.fragments.extend(replace(f, atom=part.name) for f in pieces)
        return r

    def _padded(self, r: Resolved, rule: Padded, rec: dict[str, Any], shape, base) -> Resolved:
        live = shape[rule.dim]
        if live < rule.size:
            raise PatternError(
                f"'{r.name}': padded dim {rule.dim} has {live} entries, smaller than the logical size {rule.size} "
                f"of rule {describe(rule)}",
                atom=r.name,
                saved=rule.size,
                wanted=live,
                hint="the padded size must be at least the logical size; check the rule's size",
            )
        r.fragments, r.fills = clip_padding(base, rule.dim, rule.size)
        r.fill_value = rule.fill if r.atom.kind == "model" else rule.state_fill
        r.padding_rule = rule
        logical = list(shape)
        logical[rule.dim] = rule.size
        r.atoms[r.name] = {
            **rec,
            "shape": logical,
            "pattern": "padded",
            "live_shape": list(shape),
            "rule": self._rule_index(rule),
        }
        r.paths[r.name] = r.atom.path
        return r

    def _fused(self, r: Resolved, rule: Fused, match, rec, shape, base, layout: Layout) -> Resolved:
        blocks = self._blocks(rule, r.value, layout)
        sizes = [n for _, n in rule.parts]
        problem = fused_block_problem(sizes, blocks, shape[rule.dim])
        if problem:
            raise PatternError(
                f"'{r.name}' ({list(shape)}) cannot be split by rule {describe(rule)}: {problem}",
                atom=r.name,
                saved=sizes,
                wanted=f"{blocks} blocks of dim {rule.dim} = {shape[rule.dim]}",
                hint="e.g. the KV heads must be divisible by the TP degree; pick a degree dividing every part",
            )
        parts = [r.atom.renamed(self.patterns.expand(match, t)) for t, _ in rule.parts]
        for part, n in zip(parts, sizes):
            pshape = list(shape)
            pshape[rule.dim] = n
            r.atoms[part.name] = {
                **rec,
                "param": part.param,
                "shape": pshape,
                "pattern": "fused",
                "live": r.atom.param,
                "live_shape": list(shape),
                "blocks": blocks,
                "rule": self._rule_index(rule),
            }
            r.paths[part.name] = part.path
        r.fragments = split_fused(base, rule.dim, fused_segments(sizes, blocks), [p.name for p in parts])
        if isinstance(rule.blocks, int):
            r.unsplit = base
        return r

    @staticmethod
    def _blocks(rule: Fused, value: torch.Tensor, layout: Layout) -> int:
        if isinstance(rule.blocks, int):
            return rule.blocks
        names = layout.mesh_dim_names or ()
        if isinstance(value, DTensor) and rule.blocks in names:
            i = names.index(rule.blocks)
            p = layout.placements[i]
            if p.kind.shards and p.dim == rule.dim:  # blocks exist only where that dim shards
                return layout.mesh_shape[i]
        return 1
