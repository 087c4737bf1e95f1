"""``UCPLoadPlanner``: turns the target's fragments into reads of saved chunks of the same atoms."""

from __future__ import annotations

import difflib
import io
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    STATE_DICT_TYPE,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import _init_state_dict
from torch.distributed.tensor import DTensor

from .catalog import read_catalog
from .coverage import ChunkIndex, exact_cover_problem
from .errors import CoverageError, MissingAtomsError, ParamGroupError, ShapeMismatchError, UCPError
from .fragments import Box, Fragment, layout_fragments
from .layout import Layout, dtensor_coordinate
from .naming import NameRules
from .state import Entry, GroupTarget, collect_entries, local_tensor

__all__ = ["UCPLoadPlanner"]

logger = logging.getLogger(__name__)

_GROUP_SINK = "\x00ucp-param-group"


class UCPLoadPlanner(DefaultLoadPlanner):
    """Load planner that fills any target layout from the atoms of a checkpoint.

    Args:
        allow_partial_load: skip atoms the checkpoint lacks instead of raising
            :class:`MissingAtomsError` (they are listed in ``planner.missing_atoms``).
        name_rules: wrapper segments stripped from names (must match the ones used at save).
    """

    def __init__(self, *, allow_partial_load: bool = False, name_rules: NameRules | None = None) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        self.name_rules = name_rules or NameRules()
        self.missing_atoms: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        keep = {"name_rules", "allow_partial_load", "flatten_state_dict", "flatten_sharded_tensors"}
        return {k: v for k, v in self.__dict__.items() if k in keep} | {"missing_atoms": []}

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        _init_state_dict(state_dict)
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        entries, _, groups = collect_entries(state_dict, self.name_rules, for_load=True)
        self._targets: dict[str, Entry] = {e.key: e for e in entries}
        self._groups: list[GroupTarget] = groups
        self.state_dict = {e.key: e.value for e in entries}
        self.mappings = {e.key: e.path for e in entries}

    # -- planning --------------------------------------------------------------------------------

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata
        if md is None:
            raise UCPError("no checkpoint metadata to plan against")
        read_catalog(md.planner_data)  # refuses catalogs from a newer ucp_dcp before any read
        saved = _SavedIndex(md, self.name_rules)
        self._frags: dict[str, list[Fragment]] = {}
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self.missing_atoms = []
        reads: list[ReadItem] = []
        problems: list[UCPError] = []
        for e in self._targets.values():
            try:
                reads.extend(self._plan_entry(e, saved))
            except UCPError as err:
                problems.append(err)
        for g in self._groups:
            reads.extend(self._plan_group(g, saved))
        if self.missing_atoms and not self.allow_partial_load:
            problems.insert(0, _missing_error(self.missing_atoms, saved))
        elif self.missing_atoms:
            logger.warning("UCP partial load: %d atom(s) not in the checkpoint were left as they are: %s",
                           len(self.missing_atoms), ", ".join(self.missing_atoms[:10]))
        if problems:
            raise _combine(problems)
        return LoadPlan(reads)

    def _plan_entry(self, e: Entry, saved: "_SavedIndex") -> list[ReadItem]:
        skey = saved.lookup(e.name)
        if skey is None:
            self.missing_atoms.append(e.name)
            return []
        smd = saved.md.state_dict_metadata[skey]
        if not e.is_tensor:
            if not isinstance(smd, BytesStorageMetadata):
                raise ShapeMismatchError(
                    f"atom '{e.name}' was saved as a tensor of shape {tuple(smd.size)} but the target "
                    f"holds a {type(e.value).__name__}",
                    atom=e.name, saved=tuple(smd.size), wanted=type(e.value).__name__,
                    hint="put a tensor in the target state dict for this key",
                )
            self._sinks[e.key] = lambda v, path=e.path: set_element(self.original_state_dict, path, v)
            return [_bytes_read(e.key, skey)]
        if not isinstance(smd, TensorStorageMetadata):
            raise ShapeMismatchError(
                f"atom '{e.name}' was saved as a non-tensor object but the target holds a tensor of shape "
                f"{tuple(e.value.shape)}",
                atom=e.name, saved="object", wanted=tuple(e.value.shape),
                hint="put the same kind of value in the target state dict as was saved",
            )
        want = tuple(int(s) for s in e.value.shape)
        have = tuple(int(s) for s in smd.size)
        if want != have:
            raise ShapeMismatchError(
                f"atom '{e.name}': saved shape {have}, wanted shape {want}. {_likely_cause(have, want, e.value)}",
                atom=e.name, saved=have, wanted=want,
                hint="load into a model built with the saved configuration, or declare a pattern "
                "(padding/fusion) that maps the two shapes",
            )
        if isinstance(e.value, DTensor):
            coord = dtensor_coordinate(e.value)
            if coord is None:
                return []
            frags = layout_fragments(e.name, want, Layout.from_dtensor(e.value), coord)
        else:
            frags = layout_fragments(e.name, want, Layout.replicated(), ())
        self._frags[e.key] = frags
        index = saved.chunks(skey)
        reads = []
        for i, f in enumerate(frags):
            pieces = index.overlaps(f.box)
            problem = exact_cover_problem(f.box, [ov for _, ov in pieces])
            if problem:
                raise CoverageError(
                    f"atom '{e.name}' (saved shape {have}, wanted shape {want}): wanted box {f.box} is "
                    f"not covered exactly once by the saved chunks: {problem}",
                    atom=e.name, saved=have, wanted=str(f.box),
                    hint="the checkpoint is incomplete or was written by a planner that mislabels "
                    "non-contiguous shards (stock DCP with _StridedShard); re-save it with UCPSavePlanner",
                )
            for ci, ov in pieces:
                chunk = index.boxes[ci]
                reads.append(
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex(e.key, f.box.offsets, i),
                        dest_offsets=torch.Size(ov.shift(f.box.offsets).offsets),
                        storage_index=MetadataIndex(skey, chunk.offsets, ci),
                        storage_offsets=torch.Size(ov.shift(chunk.offsets).offsets),
                        lengths=torch.Size(ov.sizes),
                    )
                )
        return reads

    def _plan_group(self, g: GroupTarget, saved: "_SavedIndex") -> list[ReadItem]:
        reads = []
        for hp in g.hyperparams:
            sink_key = f"{_GROUP_SINK}:{id(g)}:{hp}"
            found = {p: saved.lookup(g.atom(p, hp)) for p in g.params}
            if g.params and all(k is not None for k in found.values()):
                collector = _GroupCollector(g, hp, len(g.params))
                for p, skey in found.items():
                    key = f"{sink_key}:{p}"
                    self._sinks[key] = lambda v, p=p, c=collector: c.add(p, v)
                    reads.append(_bytes_read(key, skey))
                continue
            legacy = saved.lookup(g.legacy_atom(hp))
            if legacy is not None and not any(found.values()):
                # stock-DCP nested checkpoint: groups are keyed by list position
                self._sinks[sink_key] = lambda v, g=g, hp=hp: g.group.__setitem__(hp, v)
                reads.append(_bytes_read(sink_key, legacy))
                continue
            self.missing_atoms.extend(g.atom(p, hp) for p, k in found.items() if k is None)
        return reads

    # -- data ------------------------------------------------------------------------------------

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._sinks[read_item.dest_index.fqn](torch.load(value, weights_only=False))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        e = self._targets[read_item.dest_index.fqn]
        f = self._frags[e.key][read_item.dest_index.index]
        region = f.view(local_tensor(e.value))
        return narrow_tensor_by_index(region, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class _SavedIndex:
    """Saved keys by atom name; stock-DCP checkpoints get their names canonicalized the same way."""

    def __init__(self, md: Metadata, rules: NameRules) -> None:
        self.md = md
        pd = md.planner_data if isinstance(md.planner_data, dict) else {}
        self.by_atom: dict[str, str] = {}
        self.clashes: dict[str, list[str]] = {}
        for key in md.state_dict_metadata:
            path = pd.get(key)
            if not isinstance(path, tuple):
                path = (key,)
            atom = ".".join(map(str, rules.canonical_path(path)))
            if atom in self.by_atom and self.by_atom[atom] != key:
                self.clashes.setdefault(atom, [self.by_atom[atom]]).append(key)
            self.by_atom.setdefault(atom, key)
        self._chunks: dict[str, ChunkIndex] = {}

    def lookup(self, atom: str) -> str | None:
        if atom in self.clashes:
            raise UCPError(
                f"atom '{atom}' matches several saved keys {self.clashes[atom]} after wrapper stripping",
                atom=atom, saved=self.clashes[atom],
                hint="load with name_rules that keep the distinguishing segment",
            )
        return self.by_atom.get(atom)

    def chunks(self, key: str) -> ChunkIndex:
        if key not in self._chunks:
            smd = self.md.state_dict_metadata[key]
            self._chunks[key] = ChunkIndex([Box(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks])
        return self._chunks[key]


class _GroupCollector:
    """Gathers one hyperparameter of one target param group from its parameters' entries; sets it
    when all have arrived, refusing values that disagree."""

    def __init__(self, g: GroupTarget, hp: str, expected: int) -> None:
        self.g, self.hp, self.expected = g, hp, expected
        self.values: dict[str, Any] = {}

    def add(self, param: str, value: Any) -> None:
        self.values[param] = value
        if len(self.values) < self.expected:
            return
        items = list(self.values.items())
        p0, v0 = items[0]
        for p, v in items[1:]:
            if not _same(v, v0):
                raise ParamGroupError(
                    f"param group {self.g.index} of '{'.'.join(map(str, self.g.prefix))}': "
                    f"'{self.hp}' is {v0!r} for '{p0}' but {v!r} for '{p}' in the checkpoint",
                    atom=self.g.atom(p, self.hp), saved={p0: v0, p: v}, wanted=f"one value for group {self.g.index}",
                    hint="group the target optimizer's parameters the way they were grouped at save "
                    "(same hyperparameters per group)",
                )
        self.g.group[self.hp] = v0


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _bytes_read(dest_key: str, storage_key: str) -> ReadItem:
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(dest_key),
        dest_offsets=torch.Size((0,)),
        storage_index=MetadataIndex(storage_key),
        storage_offsets=torch.Size((0,)),
        lengths=torch.Size((0,)),
    )


def _likely_cause(saved: tuple[int, ...], wanted: tuple[int, ...], value: Any) -> str:
    if len(saved) != len(wanted):
        return "Likely cause: a different model definition (the ranks differ)."
    diff = [d for d in range(len(saved)) if saved[d] != wanted[d]]
    if len(diff) == 1:
        d = diff[0]
        a, b = saved[d], wanted[d]
        big, small = max(a, b), min(a, b)
        if small and big % small == 0:
            return (
                f"Likely cause: dim {d} differs by a factor of {big // small}; one side holds a local "
                "shard as a plain tensor instead of a DTensor, or a fused parameter was split/merged."
            )
        return (
            f"Likely cause: dim {d} was padded or resized ({a} vs {b}), e.g. vocabulary padding that "
            "depends on the TP degree, or a different model config."
        )
    return "Likely cause: a different model configuration."


def _missing_error(missing: list[str], saved: _SavedIndex) -> MissingAtomsError:
    lines = []
    for name in missing[:20]:
        close = difflib.get_close_matches(name, list(saved.by_atom), n=1, cutoff=0.8)
        lines.append(f"  {name}" + (f"  (closest saved: {close[0]})" if close else ""))
    more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
    return MissingAtomsError(
        f"{len(missing)} atom(s) wanted by the target are not in the checkpoint:\n" + "\n".join(lines) + more,
        atom=missing[0], saved=None, wanted=list(missing),
        hint="check the model config and wrapper names, or pass allow_partial_load=True to keep their "
        "current values",
    )


def _combine(problems: list[UCPError]) -> UCPError:
    if len(problems) == 1:
        return problems[0]
    first = problems[0]
    rest = "\n".join(f"  - {p.message.splitlines()[0]}" for p in problems[1:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return type(first)(
        f"{first.message}\n{len(problems) - 1} more problem(s):\n{rest}{more}",
        atom=first.atom, saved=first.saved, wanted=first.wanted, hint=first.hint,
    )
