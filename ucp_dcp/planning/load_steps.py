"""Load planning, as pure steps: the saved index, the reads that fill each target entry and param
group, the checks on what was saved, and the errors that explain a failed plan.

:class:`ucp_dcp.planning.load_planner.UCPLoadPlanner` strings these together.

One module, as DCP's ``default_planner.py`` keeps its steps beside each other: the steps share the saved
index (:class:`SavedIndex`) and the read-item builders. After the core steps come, in the order the planner
calls them, the checks of a load's declarations, forgotten stage/expert maps (seen at the global plan), stock
DCP's param groups matched by membership, and tied keys whose saved copies are compared when read.
"""

from __future__ import annotations

import difflib
import importlib
import io
import logging
import math
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._compat import narrow_tensor_by_index
from ..errors import (
    AmbiguousLayoutError,
    CoverageError,
    DtypeConversionError,
    MissingAtomsError,
    ParamGroupError,
    PatternError,
    ShapeMismatchError,
    UCPError,
    UnsafeCheckpointError,
)
from ..layout.dtypes import LOSS, conversion, kind
from ..layout.fragments import Box, ChunkIndex, exact_cover_problem
from ..layout.index_maps import IndexMap, map_position
from ..layout.naming import AtomName, NameRules, OptimizerForm
from ..layout.patterns import Rule, Tied, describe, rule_to_json
from .catalog import RAW_HINT, Catalog, load_catalog, raw_optimizer_error
from .entries import Entry, GroupTarget, local_tensor
from .resolve import Resolved, Resolver
from .ties import catalog_aliases, saved_equal, storage_identity

__all__ = [
    "GROUP_SINK",
    "GroupCollector",
    "SavedIndex",
    "StockGroups",
    "TieReads",
    "alias_problems",
    "bytes_read",
    "check_forgotten_maps",
    "check_raw_params",
    "check_tensor",
    "combine_problems",
    "decode_value",
    "entry_reads",
    "forgotten_map_problem",
    "group_reads",
    "itemsize",
    "lacking_maps",
    "map_reads",
    "missing_error",
    "raw_optimizer_problems",
    "raw_params_sink",
    "reduce_problem",
    "rule_conflicts",
    "saved_names",
    "split_stock_groups",
    "tie_error",
    "tie_problem",
    "use_unsplit",
    "with_map_note",
    "with_raw_note",
]

_PLAIN_DATA = {
    "_io.BytesIO": ("io", "BytesIO"),
    "builtins.frozenset": ("builtins", "frozenset"),
    "builtins.slice": ("builtins", "slice"),
    "builtins.range": ("builtins", "range"),
    "builtins.Ellipsis": ("builtins", "Ellipsis"),
}
"""Globals outside ``torch.load(weights_only=True)``'s own set that only build plain data (no
side effects, no attribute lookups by name), so stock DCP's values of these types load safely:
DCP's byte-stream items (``io.BytesIO``), frozensets, slices, ranges. Looked up in this fixed table
only, never by a saved name. numpy values are not in it: their decoding under a temporary allowance
depended on what the process had loaded before (a suite-order failure), so they stay refused unless
the user allows them (``trust=True`` or ``add_safe_globals``)."""
_PLAIN_DATA_LOCK = threading.Lock()
"""``torch.serialization.safe_globals`` edits a process-wide list: one decode at a time adds ours."""


def decode_value(data: io.BytesIO, atom: str, trust: bool = False) -> Any:
    """A saved non-tensor value, decoded with a closed set of types unless ``trust``: what
    ``torch.load(weights_only=True)`` allows, plus :data:`_PLAIN_DATA`."""
    if trust:
        return torch.load(data, weights_only=False)
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        error = e
    data.seek(0)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(data)
    data.seek(0)
    outside = [g for g in unsafe if g not in _PLAIN_DATA]
    if unsafe and not outside:
        plain = [(getattr(importlib.import_module(m), n), g) for g, (m, n) in ((g, _PLAIN_DATA[g]) for g in unsafe)]
        with _PLAIN_DATA_LOCK, torch.serialization.safe_globals(plain):
            try:
                return torch.load(data, weights_only=True)
            except pickle.UnpicklingError as e:
                error = e
    if outside:
        cause = f"types outside the safe set: {', '.join(outside)}"
        allow = f"torch.serialization.add_safe_globals([{', '.join(outside)}])"
    else:
        found = re.search(
            r"(?:Unsupported global: GLOBAL [\w.]+|Unsupported operand \S+|Trying to [^.\n]*)", str(error)
        )
        cause = f"an operation outside the safe set ({found.group(0) if found else type(error).__name__})"
        allow = "torch.serialization.add_safe_globals([...]) for the types it names"
    raise UnsafeCheckpointError(
        f"value of atom '{atom}' holds {cause}; decoding it could run code, so it was not decoded "
        "(tensors, numbers, strings, bytes, lists, dicts, tuples, sets and io.BytesIO are)",
        atom=atom,
        saved="pickled object",
        hint="if you trust where this checkpoint came from, load with trust=True (ucp_dcp.load(..., trust=True) "
        f"or UCPLoadPlanner(trust=True)); or, if those types only hold data, allow them with {allow}",
    ) from None


def itemsize(md: Metadata, item: ReadItem) -> int:
    return md.state_dict_metadata[item.storage_index.fqn].properties.dtype.itemsize


def check_tensor(name: str, smd: Any, r: Resolved, allow_lossy_dtype: bool = False) -> None:
    want = tuple(r.atoms[name]["shape"])
    if not isinstance(smd, TensorStorageMetadata):
        raise ShapeMismatchError(
            f"atom '{name}' was saved as a non-tensor object but the target holds a tensor of shape {want}",
            atom=name,
            saved="object",
            wanted=want,
            hint="put the same kind of value in the target state dict as was saved",
        )
    have = tuple(int(s) for s in smd.size)
    if want != have:
        # DCP's own words first (DefaultLoadPlanner raises them as a ValueError), then ours
        raise ShapeMismatchError(
            f"Size mismatch between saved {torch.Size(have)} and current: {torch.Size(want)} for {r.entry.key}\n"
            f"atom '{name}': saved shape {have}, wanted shape {want}. {_likely_cause(have, want, r.value)}",
            atom=name,
            saved=have,
            wanted=want,
            hint="load into a model built with the saved configuration, or declare a pattern "
            "(Padded/Fused) that maps the two shapes",
        )
    saved, wanted = smd.properties.dtype, r.local.dtype
    if not allow_lossy_dtype and saved != wanted and conversion(saved, wanted) == "lossy":
        raise DtypeConversionError(
            f"atom '{name}': saved dtype {saved}, wanted dtype {wanted}: converting would "
            f"{LOSS[(kind(saved), kind(wanted))] if wanted != torch.bool else 'turn every value into True/False'}",
            atom=name,
            saved=saved,
            wanted=wanted,
            hint=f"load into a tensor of dtype {saved} and convert it yourself, or pass "
            "UCPLoadPlanner(allow_lossy_dtype=True) to convert the way Tensor.copy_ does",
        )


def saved_names(md: Metadata, catalog: Catalog | None) -> set[str]:
    return set(md.state_dict_metadata) | (catalog.saved_names() if catalog is not None else set())


class SavedIndex:
    """Saved keys by atom name; stock-DCP checkpoints get their names canonicalized the same way."""

    def __init__(self, md: Metadata, rules: NameRules) -> None:
        self.md = md
        pd = md.planner_data if isinstance(md.planner_data, dict) else {}
        catalog = load_catalog(md.planner_data)
        atoms = catalog.atoms if catalog is not None else {}
        self.aliases = catalog_aliases(catalog)
        """Alias atom -> the atom saved for it (keys that were one tensor at save)."""
        self.by_atom: dict[str, str] = {}
        self.clashes: dict[str, list[str]] = {}
        for key in md.state_dict_metadata:
            # ucp_dcp's keys are atom names; their flatten mappings are DCP's paths (for stock tools)
            path = (key,) if key in atoms else pd.get(key)
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
                atom=atom,
                saved=self.clashes[atom],
                hint="load with name_rules that keep the distinguishing segment",
            )
        found = self.by_atom.get(atom)
        if found is None and atom in self.aliases:  # one tensor with another key at save: saved once
            return self.lookup(self.aliases[atom])
        return found

    def same_value(self, a: str, b: str) -> bool | None:
        """Whether atoms ``a`` and ``b`` hold one value in the checkpoint: one atom with aliases, or two
        saved atoms whose digests agree (None: the checkpoint cannot tell, see :func:`saved_equal`)."""
        if self.aliases.get(a, a) == self.aliases.get(b, b):
            return True
        ka, kb = self.lookup(a), self.lookup(b)
        if ka is None or kb is None:
            return None
        return True if ka == kb else saved_equal(self.md, ka, kb)

    def chunks(self, key: str) -> ChunkIndex:
        if key not in self._chunks:
            smd = self.md.state_dict_metadata[key]
            self._chunks[key] = ChunkIndex([Box(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks])
        return self._chunks[key]


class GroupCollector:
    """Gathers one hyperparameter of one target param group from its parameters' entries; sets it
    when all have arrived, refusing values that disagree."""

    def __init__(self, g: GroupTarget, hp: str, expected: int, atoms: dict[str, str]) -> None:
        self.g, self.hp, self.expected, self.atoms = g, hp, expected, atoms
        self.values: dict[str, Any] = {}

    def add(self, param: str, value: Any) -> None:
        self.values[param] = value
        if len(self.values) < self.expected:
            return
        items = list(self.values.items())
        p0, v0 = items[0]
        for p, v in items[1:]:
            if not same_value(v, v0):
                raise ParamGroupError(
                    f"param group {self.g.index} of '{'.'.join(map(str, self.g.prefix))}': "
                    f"'{self.hp}' is {v0!r} for '{p0}' but {v!r} for '{p}' in the checkpoint",
                    atom=self.atoms[p],
                    saved={p0: v0, p: v},
                    wanted=f"one value for group {self.g.index}",
                    hint="group the target optimizer's parameters the way they were grouped at save "
                    "(same hyperparameters per group)",
                )
        self.g.group[self.hp] = v0


def same_value(a: Any, b: Any) -> bool:
    """Whether two decoded values are equal (tensors bitwise); a failing comparison is 'different'."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # values whose == raises or is not a bool (arrays): not provably equal, so reported as differing
        return False


_NO_BOX = torch.Size((0,))


def bytes_read(dest_key: str, storage_key: str) -> ReadItem:
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(dest_key),
        dest_offsets=_NO_BOX,
        storage_index=MetadataIndex(storage_key),
        storage_offsets=_NO_BOX,
        lengths=_NO_BOX,
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


def missing_error(missing: list[str], saved: SavedIndex, keys: dict[str, str] | None = None) -> MissingAtomsError:
    """The error for atoms the checkpoint lacks; ``keys`` maps an atom to the target state-dict key
    that wants it (DCP's message names that key)."""
    lines, names = [], list(saved.by_atom)
    for i, name in enumerate(missing[:20]):
        # a suggestion for the first few: difflib is quadratic, and past five the pattern is clear
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8) if i < 5 else []
        lines.append(f"  {name}" + (f"  (closest saved: {close[0]})" if close else ""))
    more = f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
    key = (keys or {}).get(missing[0], missing[0])
    return MissingAtomsError(  # DCP's own words first (DefaultLoadPlanner raises them as a RuntimeError)
        f"Missing key in checkpoint state_dict: {key}.\n"
        f"{len(missing)} atom(s) wanted by the target are not in the checkpoint:\n" + "\n".join(lines) + more,
        atom=missing[0],
        saved=None,
        wanted=list(missing),
        hint="check the model config and wrapper names, or pass allow_partial_load=True to keep their current values",
    )


SHOWN_PROBLEMS = 3
"""Problems after the first printed on a line of their own; the rest are named on one line. One mistake
(a resized layer) is often dozens of problems (each weight, bias and moment), and the error is read
once per job (:func:`ucp_dcp.errors.root_cause`): a few say the pattern, the names say where."""


def combine_problems(problems: list[UCPError]) -> UCPError:
    """One error of the first problem's class carrying every problem a rank found: the first in full,
    :data:`SHOWN_PROBLEMS` more on a line each, then the atoms of the rest on one line."""
    if len(problems) == 1:
        return problems[0]
    first = problems[0]
    lines = [f"  - {p.message.splitlines()[0]}" for p in problems[1 : 1 + SHOWN_PROBLEMS]]
    if rest := problems[1 + SHOWN_PROBLEMS :]:
        lines.append(f"  - ... and {len(rest)} more, for {_names(rest)}")
    return type(first)(
        f"{first.message}\n{len(problems) - 1} more problem(s):\n" + "\n".join(lines),
        atom=first.atom,
        saved=first.saved,
        wanted=first.wanted,
        hint=first.hint,
    )


def _names(problems: list[UCPError], width: int = 160) -> str:
    """The problems' atoms (their first line where one names none), comma-separated, cut to ``width``."""
    names = [p.atom or p.message.splitlines()[0] for p in problems]
    out = ""
    for i, n in enumerate(names):
        part = n if not out else f"{out}, {n}"
        if len(part) > width:
            return f"{out} and {len(names) - i} others"
        out = part
    return out


GROUP_SINK = "\x00ucp-param-group"
"""Prefix of the sink keys of param-group hyperparameters (never a state-dict key)."""


def entry_reads(r: Resolved, saved: SavedIndex, allow_lossy_dtype: bool) -> tuple[list[ReadItem], list[str]]:
    """The reads that fill one target entry, and the atoms it wants that the checkpoint lacks.
    Raises when what was saved cannot fill it (shape, dtype, coverage)."""
    _fall_back_to_unsplit(r, saved)
    keys, missing = _saved_keys(r, saved)
    if missing:
        return [], missing
    if not r.entry.is_tensor:
        return [_object_read(r, keys, saved)], []
    for name, skey in keys.items():
        check_tensor(name, saved.md.state_dict_metadata[skey], r, allow_lossy_dtype)
    return [
        read
        for i, f in enumerate(r.fragments)
        if f.atom in keys
        for read in _fragment_reads(r, i, f, keys[f.atom], saved)
    ], []


def _fall_back_to_unsplit(r: Resolved, saved: SavedIndex) -> None:
    """Fused parts absent but the fused tensor itself saved (stock DCP / torchtitan): its block
    layout does not depend on the parallel layout, so it loads as one atom."""
    if r.unsplit is not None and not any(saved.lookup(a) for a in r.atoms) and saved.lookup(r.name):
        use_unsplit(r)


def use_unsplit(r: Resolved) -> None:
    """Load fused entry ``r`` as its unsplit tensor, one atom (a cached plan that did so does it again)."""
    if r.unsplit is None or r.fragments is r.unsplit:
        return
    r.fragments = r.unsplit
    r.atoms = {
        r.name: {
            **next(iter(r.atoms.values())),
            "shape": list(r.value.shape) if isinstance(r.value, torch.Tensor) else None,
        }
    }
    r.fanout = False


def _saved_keys(r: Resolved, saved: SavedIndex) -> tuple[dict[str, str], list[str]]:
    """Saved key of every atom the entry needs (a fan-out entry needs its first), and the missing."""
    names = list(r.atoms)[:1] if r.fanout else list(r.atoms)
    keys = {n: saved.lookup(n) for n in names}
    return {n: k for n, k in keys.items() if k is not None}, [n for n, k in keys.items() if k is None]


def _object_read(r: Resolved, keys: dict[str, str], saved: SavedIndex) -> ReadItem:
    ((name, skey),) = keys.items()
    smd = saved.md.state_dict_metadata[skey]
    if not isinstance(smd, BytesStorageMetadata):
        raise ShapeMismatchError(  # DCP's own words first (a ValueError there too)
            f"Invalid checkpoint metadata for {r.entry.key}, expected BytesStorageMetadata but found {type(smd)}\n"
            f"atom '{name}' was saved as a tensor of shape {tuple(smd.size)} but the target "
            f"holds a {type(r.entry.value).__name__}",
            atom=name,
            saved=tuple(smd.size),
            wanted=type(r.entry.value).__name__,
            hint="put a tensor in the target state dict for this key",
        )
    return bytes_read(r.entry.key, skey)


def _fragment_reads(r: Resolved, i: int, f: Any, skey: str, saved: SavedIndex) -> list[ReadItem]:
    """Reads of the saved chunks that cover fragment ``i`` of the entry, exactly once."""
    index = saved.chunks(skey)
    pieces = index.overlaps(f.box)
    problem = exact_cover_problem(f.box, [ov for _, ov in pieces])
    if problem:
        have = tuple(saved.md.state_dict_metadata[skey].size)
        raise CoverageError(
            f"atom '{f.atom}' (saved shape {have}, wanted shape {tuple(r.atoms[f.atom]['shape'])}): "
            f"wanted box {f.box} is not covered exactly once by the saved chunks: {problem}",
            atom=f.atom,
            saved=have,
            wanted=str(f.box),
            hint="the checkpoint is incomplete or was written by a planner that mislabels "
            "non-contiguous shards (stock DCP with _StridedShard); re-save it with UCPSavePlanner",
        )
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(r.entry.key, f.box.offsets, i),
            dest_offsets=torch.Size(ov.shift(f.box.offsets).offsets),
            storage_index=MetadataIndex(skey, index.boxes[ci].offsets, ci),
            storage_offsets=torch.Size(ov.shift(index.boxes[ci].offsets).offsets),
            lengths=torch.Size(ov.sizes),
        )
        for ci, ov in pieces
    ]


def group_reads(
    g: GroupTarget, saved: SavedIndex, resolver: Resolver
) -> tuple[list[ReadItem], dict[str, Callable[[Any], None]], list[str]]:
    """Reads of one target param group's hyperparameters, the sinks that set them, and the atoms
    the checkpoint lacks. Each hyperparameter is saved per parameter; a stock-DCP checkpoint keys
    it by group position instead."""
    reads: list[ReadItem] = []
    sinks: dict[str, Callable[[Any], None]] = {}
    missing: list[str] = []
    # a parameter's atoms differ between hyperparameters only in the last segment: resolve each
    # parameter once (tie and fused resolution, index maps), not once per hyperparameter
    stems = {p: _group_stem(resolver, g, p, g.hyperparams[0]) for p in g.params} if g.hyperparams else {}
    for hp in g.hyperparams:
        sink_key = f"{GROUP_SINK}:{id(g)}:{hp}"
        atoms = {p: stems[p] + hp if stems[p] is not None else group_atom(resolver, g, p, hp) for p in g.params}
        found = {p: saved.lookup(a) for p, a in atoms.items()}
        if g.params and all(k is not None for k in found.values()):
            collector = GroupCollector(g, hp, len(g.params), atoms)
            for p, skey in found.items():
                sinks[f"{sink_key}:{p}"] = lambda v, p=p, c=collector: c.add(p, v)
                reads.append(bytes_read(f"{sink_key}:{p}", skey))
            continue
        legacy = saved.lookup(g.legacy_atom(hp))
        if legacy is not None and not any(found.values()):  # stock DCP: keyed by list position
            sinks[sink_key] = lambda v, g=g, hp=hp: g.group.__setitem__(hp, v)
            reads.append(bytes_read(sink_key, legacy))
            continue
        missing.extend(atoms[p] for p, k in found.items() if k is None)
    return reads, sinks, missing


def _group_stem(resolver: Resolver, g: GroupTarget, param: str, hp: str) -> str | None:
    """The atom name of ``param``'s hyperparameter ``hp`` without ``hp`` (None if it does not end so)."""
    atom = group_atom(resolver, g, param, hp)
    return atom[: -len(hp)] if atom.endswith("." + hp) else None


def group_atom(resolver: Resolver, g: GroupTarget, param: str, hp: str) -> str:
    """The atom holding hyperparameter ``hp`` of ``param`` (after tie and fused resolution)."""
    name = AtomName(tuple(g.prefix) + ("param_groups",), param, (hp,), "param_group", form=OptimizerForm.NESTED)
    return next(iter(resolver.resolve(Entry(name.name, name, None, name.path)).atoms))


# -- a load's declarations checked against what the checkpoint and the target state hold -----------------------------
# The rules and maps a load passes describe the *target*; the catalog records what was declared at
# save. Where the two disagree in a way that changes meaning, the load is refused before a byte is
# read: a map the checkpoint was saved with and this load lacks (its stage-local names then miss or
# collide; on plain tensors :mod:`ucp_dcp.planning.load_steps` sees it at the global plan), a
# ``Tied`` rule declared only at load over an atom the checkpoint holds separately (its saved values
# would be replaced by the tied parameter's), and target keys that alias one storage under different
# atoms (one of the two loads would silently overwrite the other).


_MAP_ARG = {"layers": "stage_map", "experts": "expert_map"}


def with_map_note(err: UCPError, saved_maps: Iterable[str], load_maps: Iterable[str]) -> UCPError:
    """``err`` with the index maps the checkpoint was saved with and this load lacks named first:
    a forgotten map shows up as missing or mismatched atoms, whose own message would hide it."""
    lacking = sorted(set(saved_maps) - set(load_maps))
    if not lacking:
        return err
    args = ", ".join(_MAP_ARG.get(k, f"IndexMap({k!r})") for k in lacking)
    note = (
        f"The checkpoint was saved with index map(s) {lacking} ({args}) and this load passes none: if this "
        "layout numbers its layers or experts locally (pipeline stages, expert-parallel ranks), pass the "
        f"{args} for this rank's layout."
    )
    return type(err)(
        f"{err.message}\n{note}",
        atom=err.atom,
        saved=err.saved,
        wanted=err.wanted,
        hint=f"pass {args} for the new layout (or, if its names are global, check the names); " + (err.hint or ""),
    )


def tie_problem(r: Any, saved: Any, saved_rules: Sequence[Rule], rules: Sequence[Rule]) -> UCPError | None:
    """A target entry a ``Tied`` rule renamed to another parameter's atom, while the checkpoint
    holds the entry's own atom and was not saved with that tie: accepted when the checkpoint shows
    the two saved atoms are bitwise one value (its digests agree, or they were one tensor at save),
    refused otherwise, since loading the tied atom would replace the saved values (``saved``: the
    :class:`~ucp_dcp.planning.load_steps.SavedIndex`, ``rules``: this load's declared rules)."""
    own = r.entry.atom
    if not r.tied or own.param == r.atom.param:
        return None
    rule = next((x for x in rules if isinstance(x, Tied) and x.param == r.atom.param), None)
    if rule is None or rule in saved_rules or saved.lookup(own.name) is None:
        return None
    same = saved.same_value(own.name, r.atom.name)
    if same:
        return None
    why = (
        "their saved values differ (their digests disagree)"
        if same is False
        else "the checkpoint cannot show they are equal (no checksums, or saved in other chunks)"
    )
    return PatternError(
        f"rule {describe(rule)} (declared at load, not at save) loads '{r.atom.name}' into '{r.entry.key}', "
        f"but the checkpoint holds '{own.name}' as an atom of its own and {why}: its saved values would be replaced",
        atom=own.name,
        saved=f"'{own.name}' and '{r.atom.name}' saved separately",
        wanted=f"tied to '{r.atom.param}'",
        hint=f"drop the Tied rule and give '{r.entry.key}' a tensor of its own (untie the tied parameters): each saved "
        "atom then loads into its own key; tie them afterwards with the value you choose",
    )


def alias_problems(resolved: Sequence[Any], saved: Any) -> tuple[list[UCPError], set[str], dict[str, str]]:
    """Target keys whose local memory overlaps but which load different atoms, unless they view one
    tensor the same way and the checkpoint holds one value for both (``saved``, the
    :class:`~ucp_dcp.planning.load_steps.SavedIndex`: one atom with aliases, or equal digests): a tied
    model loading its own tie. Also returns the keys whose reads would only repeat another key's (the
    later views of one tensor that loads one value): they need no reads of their own; and the keys of
    one tensor whose saved copies the checkpoint cannot show equal (stock DCP saved both names,
    without checksums) but that are saved tensors of one shape and dtype: key -> the key whose value
    loads. Both copies are then read and compared when read (:mod:`ucp_dcp.planning.load_steps`)."""
    spans: dict[tuple[str, int], list[tuple[int, int, Any]]] = {}
    for r in resolved:
        if not r.present or not isinstance(r.value, torch.Tensor):
            continue
        t = local_tensor(r.value)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
            continue
        st = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        spans.setdefault((str(t.device), st.data_ptr()), []).append((lo, hi, r))
    out: list[UCPError] = []
    repeats: set[str] = set()
    compared: dict[str, str] = {}
    for items in spans.values():
        items.sort(key=lambda x: x[0])
        for (_lo1, hi1, a), (lo2, _hi2, b) in zip(items, items[1:]):
            if lo2 >= hi1:
                continue
            one_view = len(a.atoms) == len(b.atoms) == 1 and storage_identity(a.value) == storage_identity(b.value)
            if set(a.atoms) & set(b.atoms):
                if one_view and set(a.atoms) == set(b.atoms) and not a.fills and not b.fills:
                    repeats.add(b.entry.key)  # one tensor, one atom (a declared tie): read once
                continue
            equal = saved.same_value(next(iter(a.atoms)), next(iter(b.atoms))) if one_view else None
            if equal:
                repeats.add(b.entry.key)  # both keys view one tensor that receives one value
                continue
            if equal is None and one_view and a.entry.key not in repeats and _comparable(a, b, saved):
                compared[b.entry.key] = compared.get(a.entry.key, a.entry.key)  # read both, compare, load one
                continue
            why = {
                False: "the checkpoint holds different values for them",
                None: "the checkpoint cannot show they hold one value (saved separately, without ucp_dcp's "
                "checksums or in other chunks)",
            }[equal if one_view else None]
            out.append(tie_error(a.entry.key, b.entry.key, sorted(a.atoms)[0], sorted(b.atoms)[0], why))
    return out, repeats, compared


def _comparable(a: Any, b: Any, saved: Any) -> bool:
    """Whether the saved copies of two keys viewing one tensor can be compared when read: both saved as
    tensors of one shape and dtype (:func:`~ucp_dcp.planning.ties.saved_equal` refuses others), each
    key's fragments the same boxes, no padding."""
    keys = [saved.lookup(next(iter(r.atoms))) for r in (a, b)]
    smd = [saved.md.state_dict_metadata.get(k) if k is not None else None for k in keys]
    return (
        all(isinstance(m, TensorStorageMetadata) for m in smd)
        and not a.fills
        and not b.fills
        and not a.fanout
        and not b.fanout
        and [f.box for f in a.fragments] == [f.box for f in b.fragments]
    )


def tie_error(a: str, b: str, atom_a: str, atom_b: str, why: str) -> AmbiguousLayoutError:
    """Target keys ``a`` and ``b`` share memory but load atoms the checkpoint does not hold as one value
    (``why``): refused at plan time, or when read (:mod:`ucp_dcp.planning.load_steps`)."""
    return AmbiguousLayoutError(
        f"target keys '{a}' and '{b}' share memory but load different atoms ({atom_a!r} and {atom_b!r}): "
        f"{why}, and one load would overwrite the other",
        atom=atom_b,
        saved=[atom_a, atom_b],
        wanted="one value",
        hint=f"give '{b}' a tensor of its own (untie the tied parameters) to load each saved value "
        "into its own key, then tie them with the value you choose",
    )


_LAYOUT_FIELDS = {
    "fused": ("parts", "dim", "blocks"),
    "tied": ("param", "aliases"),
    "reduce": ("op",),
    "padded": ("size", "dim"),
}
"""The fields of a rule that decide how saved atoms relate to live values (not ``fill``, ``check``)."""


def rule_conflicts(declared: Sequence[Rule], saved_rules: Sequence[Rule], catalog: Catalog | None) -> list[UCPError]:
    """Rules this load declares that describe a parameter the checkpoint holds differently from the
    rule it was saved with (same kind, both match one saved name, other layout fields): the saved
    atoms were cut by the saved rule, so the declared one would put their rows in the wrong places."""
    import re

    names = catalog.saved_names() if catalog is not None else set()
    out: list[UCPError] = []
    for d in declared:
        fields = _LAYOUT_FIELDS.get(d.kind)
        if fields is None or d in saved_rules:
            continue
        for s in saved_rules:
            if s.kind != d.kind or all(_layout_field(s, f) == _layout_field(d, f) for f in fields):
                continue
            if d.kind == "fused" and _part_sizes(s) != _part_sizes(d):
                # another model config (e.g. other KV heads, so other sizes and blocks): the part atoms'
                # shapes differ, which the load reports as a ShapeMismatchError naming both shapes
                continue
            both = sorted(n for n in names if re.fullmatch(s.pattern, n) and re.fullmatch(d.pattern, n))
            if both:
                out.append(
                    PatternError(
                        f"rule {describe(d)} declared at load describes '{both[0]}' differently from the rule it was "
                        f"saved with, {describe(s)}: "
                        + ", ".join(
                            f"{f} {getattr(s, f)!r} at save, {getattr(d, f)!r} now"
                            for f in fields
                            if _layout_field(s, f) != _layout_field(d, f)
                        ),
                        atom=both[0],
                        saved=rule_json(s),
                        wanted=rule_json(d),
                        hint="pass the rule the checkpoint was saved with (or none: the saved rules apply by themselves); "
                        "if the target model really lays this parameter out differently, load with strict=False",
                    )
                )
                break
    return out


def _layout_field(rule: Rule, name: str) -> Any:
    """A rule field as the conflict check compares it: a Fused rule's part *names* (their sizes are the
    model's shapes: a size change is a shape mismatch, reported as one, with both shapes)."""
    value = getattr(rule, name)
    return tuple(t for t, _ in value) if name == "parts" else value


def _part_sizes(rule: Rule) -> tuple[int, ...]:
    return tuple(n for _, n in getattr(rule, "parts", ()))


def rule_json(rule: Rule) -> dict[str, Any]:
    return rule_to_json(rule)


def reduce_problem(r: Any, catalog: Catalog | None) -> UCPError | None:
    """A ``Reduce`` rule applied at load to an atom the checkpoint saved without one: what was saved
    is one rank's copy (checked equal across ranks), which the load would take for the reduced total."""
    if r.reduce is None or not catalog:
        return None
    rec = catalog.atoms.get(r.name)
    if rec is None or (rec.pattern or "").startswith("reduce:"):
        return None
    return PatternError(
        f"rule {describe(r.reduce)} reduces '{r.name}' at load, but the checkpoint saved it without a reduction "
        f"(pattern {rec.pattern!r}: one rank's copy): the load would take that copy for the {r.reduce.op}",
        atom=r.name,
        saved=rec.pattern,
        wanted=f"reduce:{r.reduce.op}",
        hint="declare the Reduce rule at save too (the save then reduces every rank's value), or load without it",
    )


def raw_optimizer_problems(
    target_raw: Mapping[str, list[list[int]]], catalog: Catalog | None, target_names: Iterable[str]
) -> list[UCPError]:
    """Raw ``optimizer.state_dict()`` values (parameters keyed by position) that this load cannot fill
    exactly: positions other than the checkpoint's (another parameter order or count, another
    pipeline stage), or one side keyed by position and the other by name. Stock checkpoints (no
    catalog) are checked when their ``params`` lists are read."""
    if catalog is None:
        return []
    saved_raw = catalog.raw_optimizers
    out: list[UCPError] = []
    for prefix, groups in target_raw.items():
        if prefix not in saved_raw:
            out.append(
                raw_optimizer_error(
                    prefix,
                    f"the target's '{prefix}' is a raw optimizer.state_dict() (parameters keyed by position), but the "
                    "checkpoint does not hold it in that form (its optimizer state is keyed by parameter name, or absent)",
                    "keyed by name",
                    groups,
                )
            )
        elif saved_raw[prefix] != groups:
            out.append(
                raw_optimizer_error(
                    prefix,
                    f"the checkpoint's raw optimizer.state_dict() '{prefix}' lists parameter positions "
                    f"{saved_raw[prefix]}, the target's {groups}: position i would name another parameter",
                    saved_raw[prefix],
                    groups,
                )
            )
    names = list(target_names)
    for prefix in sorted(set(saved_raw) - set(target_raw)):
        if any(n.startswith((f"{prefix}.state.", f"{prefix}.param_groups.")) for n in names):
            out.append(
                raw_optimizer_error(
                    prefix,
                    f"the checkpoint holds '{prefix}' as a raw optimizer.state_dict() (parameters keyed by position), "
                    "the target keys it by parameter name: positions cannot be matched to names",
                    saved_raw[prefix],
                    "keyed by name",
                )
            )
    return out


def raw_params_sink(r: Any, target_raw: Mapping[str, Any]) -> Callable[[Any], None] | None:
    """Where a raw optimizer's ``params`` list goes when read: checked against the target's (a stock
    checkpoint's positions are only known then), not written; None for any other entry."""
    a = r.entry.atom
    prefix = ".".join(map(str, a.prefix[:-1]))
    if a.kind != "param_group" or a.suffix != ("params",) or prefix not in target_raw:
        return None
    want = r.value
    return lambda v: check_raw_params(prefix, v, want)


def check_raw_params(prefix: str, saved: Any, wanted: Any) -> None:
    """A stock checkpoint's ``params`` list of a raw optimizer's group, read, against the target's."""
    if saved != wanted:
        raise raw_optimizer_error(
            prefix,
            f"the checkpoint's raw optimizer.state_dict() '{prefix}' lists parameter positions {saved} in a group "
            f"where the target lists {wanted}: position i would name another parameter",
            saved,
            wanted,
        )


def with_raw_note(err: UCPError, problems: Sequence[UCPError], raw_prefixes: Iterable[str]) -> UCPError:
    """``err`` with a note when some problem concerns a raw ``optimizer.state_dict()`` of the target (a
    stock checkpoint's, whose positions are not recorded): a position naming another parameter than at
    save shows up as a shape mismatch or a missing key, whose own hint would not say why."""
    hit = sorted({x for x in raw_prefixes for p in problems if (p.atom or "").startswith(x + ".")})
    if not hit:
        return err
    note = (
        f"'{hit[0]}' is a raw optimizer.state_dict(): its state is keyed by parameter position, and a position "
        "that named another parameter at save shows up as the problem above."
    )
    return type(err)(f"{err.message}\n{note}", atom=err.atom, saved=err.saved, wanted=err.wanted, hint=RAW_HINT)


# -- a stage or expert map the checkpoint was saved with, forgotten at load on plain tensors -------------------------
# Saved with a ``stage_map`` (``expert_map``) and loaded at the same layout without it, every stage
# (expert rank) names its entries ``layers.0``, ``layers.1``, ...: its local numbers. DTensor targets show
# the mistake by their meshes (:mod:`ucp_dcp.layout.structure`); plain tensors have none, so one stage
# cannot be told from a data-parallel replica and every stage would load the first stage's layers. What
# is left to see is at the global plan: ranks read the same map-numbered atoms while entries of the
# checkpoint go unread by every rank. Each rank sends the map-numbered atoms it reads (only when a map
# is lacking) and the coordinator refuses such a load on every rank, or, with ``allow_partial_load``,
# logs it and lets it go on.


logger = logging.getLogger(__name__)


def lacking_maps(catalog: Catalog | None, maps: Iterable[IndexMap]) -> list[str]:
    """Keys of the index maps the checkpoint was saved with that this load (``maps``) does not pass."""
    return sorted(set(catalog.maps if catalog is not None else ()) - {m.key for m in maps})


def map_reads(catalog: Catalog | None, maps: Iterable[IndexMap], reads: Iterable[ReadItem]) -> list[str]:
    """The saved atoms a rank's ``reads`` read that number an entry of a map the load lacks (``layers.<i>``)."""
    lacking = lacking_maps(catalog, maps)
    if not lacking:
        return []
    return sorted({n for n in (it.storage_index.fqn for it in reads) if any(map_position(n, k) for k in lacking)})


def check_forgotten_maps(
    catalog: Catalog | None,
    md: Metadata,
    maps: Iterable[IndexMap],
    reads: Sequence[Iterable[str]],
    allow_partial_load: bool,
) -> None:
    """At the global plan: refuse the load :func:`forgotten_map_problem` finds in the checkpoint ``md``
    (``reads``: each rank's :func:`map_reads`), or, with ``allow_partial_load``, log it and let it go on."""
    lacking = lacking_maps(catalog, maps)
    problem = forgotten_map_problem(md.state_dict_metadata, lacking, reads) if lacking else None
    if problem is not None and not allow_partial_load:
        raise problem
    if problem is not None:
        logger.warning("UCP partial load (allow_partial_load=True) goes on: %s", problem.message)


def forgotten_map_problem(
    saved: Iterable[str], lacking: Sequence[str], reads: Sequence[Iterable[str]]
) -> AmbiguousLayoutError | None:
    """A map the checkpoint was saved with (``lacking``: its keys) forgotten at load on targets that
    cannot show it by their meshes (plain tensors): ranks read the same map-numbered atoms while the
    checkpoint holds entries that no rank reads at all -- every stage (expert rank) loads the first
    stage's layers (experts) into its own. ``saved``: the checkpoint's atom names; ``reads``: per rank
    of the load (plan order), the saved atoms it reads that are numbered by a lacking map.

    An entry counts as read when any atom numbered by it is (a load of the model alone, or of an
    optimizer with state for some parameters only, reads every entry through some atom)."""
    reads = [set(r) for r in reads]
    for key in lacking:
        saved_at: dict[int, list[str]] = {}
        for name in saved:
            pos = map_position(name, key)
            if pos is not None:
                saved_at.setdefault(pos[1], []).append(name)
        readers: dict[str, list[int]] = {}
        read_at: set[int] = set()
        for rank, names in enumerate(reads):
            for name in names:
                pos = map_position(name, key)
                if pos is not None:
                    read_at.add(pos[1])
                    readers.setdefault(name, []).append(rank)
        unread = sorted(set(saved_at) - read_at)
        shared = {n: r for n, r in sorted(readers.items()) if len(r) > 1}
        if not (unread and shared):
            continue
        arg = _MAP_ARG.get(key, f"IndexMap({key!r})")
        examples = sorted(n for i in unread[:2] for n in saved_at[i])[:4]
        more = sum(len(saved_at[i]) for i in unread) - len(examples)
        ranks = sorted({r for rs in shared.values() for r in rs})
        return AmbiguousLayoutError(
            f"the checkpoint was saved with index map '{key}' ({arg}) and this load passes none: ranks {ranks} of "
            f"the load read the same {key} atoms ({', '.join(list(shared)[:3])}{', ...' if len(shared) > 3 else ''}) "
            f"while no rank reads {key} {unread[:10]}{' ...' if len(unread) > 10 else ''} of the checkpoint "
            f"({', '.join(examples)}{f' and {more} more atom(s)' if more else ''}): without the map each rank's "
            f"local {key}.0, {key}.1, ... load the first saved {key} instead of its own",
            atom=examples[0],
            saved=[f"{key}.{i}" for i in unread],
            wanted={n: shared[n] for n in list(shared)[:10]},
            hint=f"pass the {arg} of this layout on every rank, as at save; to load only part of the checkpoint's "
            f"{key} on purpose, pass allow_partial_load=True",
        )
    return None


# -- param groups of a checkpoint written by stock DCP, matched to the target's groups by membership -----------------
# Stock DCP keys a nested optimizer's groups by list position (``optim.param_groups.<i>.lr``) and
# saves each group's parameter names beside them (``optim.param_groups.<i>.params``). The position
# depends on how the new job lists its groups, so matching by it silently swaps hyperparameters
# (lr, weight decay) between groups. Here every saved group's ``params`` list and hyperparameters are
# read, and each target group takes the values of the saved group(s) holding its parameters:
# ``set_state_dict`` after a stock ``dcp.load`` does the same through the names. Groups whose
# parameters are saved as list positions (a raw ``optimizer.state_dict()``) carry no names and keep
# DCP's positional matching.


class StockGroups:
    """The reads and sinks that fill one optimizer's target groups from a stock checkpoint."""

    def __init__(
        self, prefix: str, targets: Sequence[GroupTarget], saved: dict[int, dict[str, str]], names: NameRules
    ) -> None:
        self.prefix, self.targets, self.saved, self.names = prefix, list(targets), saved, names
        self.values: dict[int, dict[str, Any]] = {i: {} for i in saved}
        self.reads: list[ReadItem] = []
        self.sinks: dict[str, Callable[[Any], None]] = {}
        wanted = {hp for g in self.targets for hp in g.hyperparams} | {"params"}
        for i, keys in sorted(saved.items()):
            for hp, skey in keys.items():
                if hp in wanted:
                    sink = f"{GROUP_SINK}:stock:{prefix}:{i}:{hp}"
                    self.sinks[sink] = lambda v, i=i, hp=hp: self._add(i, hp, v)
                    self.reads.append(bytes_read(sink, skey))
        self.pending = len(self.reads)

    @classmethod
    def find(
        cls, prefix: str, targets: Sequence[GroupTarget], saved_keys: dict[str, str], names: NameRules
    ) -> StockGroups | None:
        """The matcher for the optimizer at ``prefix`` when the checkpoint keys its groups by position
        and lists their parameters (``saved_keys``: atom name -> saved key); else None."""
        rx = re.compile(re.escape(prefix) + r"\.param_groups\.(\d+)\.([^.]+)")
        saved: dict[int, dict[str, str]] = {}
        for atom, key in saved_keys.items():
            m = rx.fullmatch(atom)
            if m:
                saved.setdefault(int(m.group(1)), {})[m.group(2)] = key
        if not saved or not all("params" in g for g in saved.values()):
            return None
        return cls(prefix, targets, saved, names)

    def missing(self) -> list[str]:
        """Hyperparameters some target group wants that no saved group holds."""
        have = {hp for keys in self.saved.values() for hp in keys}
        return sorted(
            {f"{self.prefix}.param_groups.<i>.{hp}" for g in self.targets for hp in g.hyperparams if hp not in have}
        )

    def _add(self, i: int, hp: str, value: Any) -> None:
        self.values[i][hp] = value
        self.pending -= 1
        if self.pending == 0:
            self._match()

    def _match(self) -> None:
        lists = {i: v.get("params") for i, v in self.values.items()}
        if not all(isinstance(p, (list, tuple)) and all(isinstance(x, str) for x in p) for p in lists.values()):
            self._by_position()
            return
        owner: dict[str, int] = {}
        for i, params in sorted(lists.items()):
            for p in params:
                owner[self.names.canonical_elem(str(p)) or str(p)] = i
        for g in self.targets:
            homes = {p: owner.get(p) for p in g.params}
            lost = [p for p, i in homes.items() if i is None]
            if lost:
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}': parameter '{lost[0]}' is in none of the "
                    f"checkpoint's {len(lists)} param groups ({len(lost)} such parameter(s))",
                    atom=f"{self.prefix}.param_groups.{g.index}",
                    saved=sorted(owner)[:20],
                    wanted=lost[:20],
                    hint="the checkpoint's groups list other parameters: load into the model it was saved from",
                )
            self._assign(g, sorted(set(homes.values())))

    def _by_position(self) -> None:
        if len(self.values) != len(self.targets):
            raise ParamGroupError(
                f"'{self.prefix}': the checkpoint has {len(self.values)} param groups listed by position, the "
                f"target {len(self.targets)}",
                atom=f"{self.prefix}.param_groups",
                saved=len(self.values),
                wanted=len(self.targets),
                hint="build the optimizer with the groups it was saved with",
            )
        for g in self.targets:
            self._assign(g, [g.index])

    def _assign(self, g: GroupTarget, homes: list[int]) -> None:
        for hp in g.hyperparams:
            found = {i: self.values[i][hp] for i in homes if hp in self.values[i]}
            if len(found) < len(homes):
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}': the checkpoint's group(s) "
                    f"{[i for i in homes if i not in found]} hold no '{hp}'",
                    atom=f"{self.prefix}.param_groups.{hp}",
                    hint="load into an optimizer of the kind that was saved, or pass allow_partial_load=True",
                )
            vals = list(found.values())
            if any(not same_value(v, vals[0]) for v in vals[1:]):
                raise ParamGroupError(
                    f"param group {g.index} of '{self.prefix}' holds parameters of the checkpoint's groups {homes}, "
                    f"whose '{hp}' differ: " + ", ".join(f"group {i}: {v!r}" for i, v in found.items()),
                    atom=f"{self.prefix}.param_groups.{g.index}.{hp}",
                    saved=found,
                    wanted=f"one '{hp}'",
                    hint="group the target optimizer's parameters the way they were grouped at save",
                )
            g.group[hp] = vals[0]


def split_stock_groups(
    groups: list[GroupTarget], saved: SavedIndex, resolver: Resolver, rules: NameRules
) -> tuple[list[GroupTarget], list[StockGroups]]:
    """The optimizers whose groups a stock-DCP checkpoint keys by position, matched by membership
    (:class:`StockGroups`), and the target groups left to the per-parameter path."""
    rest: list[GroupTarget] = []
    found: list[StockGroups] = []
    by_prefix: dict[str, list[GroupTarget]] = {}
    for g in groups:
        by_prefix.setdefault(".".join(map(str, g.prefix)), []).append(g)
    for prefix, members in by_prefix.items():
        per_param = any(
            saved.lookup(group_atom(resolver, g, p, hp))
            for g in members
            for p in g.params[:1]
            for hp in g.hyperparams[:1]
        )
        stock = None if per_param else StockGroups.find(prefix, members, saved.by_atom, rules)
        if stock is None:
            rest.extend(members)
        else:
            found.append(stock)
    return rest, found


# -- tied target keys whose two saved copies are compared when read (a tied model saved by stock DCP) ----------------
# Stock ``dcp.save`` writes a tied model's shared ``Parameter`` under each of its names, as copies, and
# records no checksums that :func:`~ucp_dcp.planning.ties.saved_equal` could compare at plan time. A
# tied target loading such a checkpoint reads every copy (the reads planned for each key, as for an
# untied target) into scratch memory of the saved dtype instead of the target, one fragment of the
# shared tensor at a time. When every read of a fragment has arrived the copies are compared bitwise:
# equal, the first key's value is copied into the reads' destinations and they are committed (one
# value, the tie kept); different, :class:`~ucp_dcp.errors.AmbiguousLayoutError` is raised with the
# hint of the plan-time refusal (untie the target), and nothing of that tensor is written on this rank.
#
# :func:`~ucp_dcp.planning.load_steps.alias_problems` picks the keys, ``UCPLoadPlanner`` routes their
# reads here (``resolve_tensor`` hands out the scratch, ``commit_tensor`` the comparison).


@dataclass
class _Fragment:
    """One fragment of a tied tensor being read: every key's copy, the reads that arrived."""

    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: dict[str, int] = field(default_factory=dict)
    done: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)


class TieReads:
    """The reads of tied keys compared when read, for one load (``compared``: compared key -> the key
    whose value loads, the first of its tensor; ``reads``: this rank's final read items)."""

    def __init__(
        self, compared: Mapping[str, str], targets: Mapping[str, Any], reads: Sequence[ReadItem], md: Metadata
    ):
        self._loader = {**{a: a for a in compared.values()}, **compared}
        self._atoms = {k: next(iter(targets[k].atoms)) for k in self._loader}
        self._boxes = {k: [f.box for f in targets[k].fragments] for k in self._loader}
        self._md = md
        counts: dict[tuple[str, int], dict[str, int]] = {}
        for it in reads:
            key = it.dest_index.fqn
            if key in self._loader:
                need = counts.setdefault((self._loader[key], it.dest_index.index or 0), {})
                need[key] = need.get(key, 0) + math.prod(it.lengths)
        for (loader, _), need in counts.items():
            keys = [loader] + sorted(k for k, a in compared.items() if a == loader)
            if len({need.get(k, 0) for k in keys}) > 1:  # an override dropped some reads of the tensor
                raise UCPError(
                    f"create_local_plan: the reads of {keys} (one tensor, whose saved copies are compared when "
                    f"read) were dropped for some keys but not all: {need}",
                    atom=self._atoms[loader],
                    hint="drop the reads of every key of a tied tensor, or of none",
                )
        self._need = counts
        self._open: dict[tuple[str, int], _Fragment] = {}
        self._dest: dict[int, torch.Tensor] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()

    def holds(self, item: ReadItem) -> bool:
        return item.dest_index.fqn in self._loader

    def scratch(self, item: ReadItem, dest: torch.Tensor) -> torch.Tensor:
        """Where the reader puts the bytes of ``item``: its box of the key's copy of the fragment (saved
        dtype); ``dest`` (what the read would have filled) gets the value once the copies compare equal."""
        key, i = item.dest_index.fqn, item.dest_index.index or 0
        with self._lock:
            frag = self._open.setdefault((self._loader[key], i), _Fragment())
            copy = frag.scratch.get(key)
            if copy is None:
                smd = self._md.state_dict_metadata[item.storage_index.fqn]
                assert isinstance(smd, TensorStorageMetadata)  # alias_problems compares saved tensors only
                dtype = smd.properties.dtype
                copy = frag.scratch[key] = torch.empty(self._boxes[key][i].sizes, dtype=dtype)
            self._dest[id(item)] = dest
        return narrow_tensor_by_index(copy, item.dest_offsets, item.lengths)

    def arrive(self, item: ReadItem, tensor: torch.Tensor) -> list[tuple[ReadItem, torch.Tensor]]:
        """``item`` was read into ``tensor``: nothing to commit yet ([]), or, its fragment complete and its
        copies equal, every read of the fragment with its destination, which now holds the value."""
        key, i = item.dest_index.fqn, item.dest_index.index or 0
        loader = self._loader[key]
        with self._lock:
            frag = self._open.get((loader, i))
            dest = self._dest.pop(id(item), None)
            copy = frag.scratch.get(key) if frag is not None else None
            if (
                frag is None
                or copy is None
                or dest is None
                or tensor.untyped_storage().data_ptr() != copy.untyped_storage().data_ptr()
            ):
                raise UCPError(
                    f"'{key}' is one tensor with {sorted(k for k, a in self._loader.items() if a == loader)}, whose "
                    "saved copies are compared when read into scratch memory; commit_tensor got another tensor "
                    f"than resolve_tensor handed out for it ({type(tensor).__name__} {tuple(tensor.shape)})",
                    atom=self._atoms[key],
                    hint="let an override of resolve_tensor return super().resolve_tensor(read_item), and commit "
                    "the tensor it returned",
                )
            frag.done.append((item, dest))
            frag.arrived[key] = frag.arrived.get(key, 0) + math.prod(item.lengths)
            if frag.arrived != self._need[(loader, i)]:
                return []
            del self._open[(loader, i)]
        value = frag.scratch[loader]
        for other in sorted(frag.scratch):
            if other != loader:
                self._compare(loader, other, i, value, frag.scratch[other])
        with torch.no_grad():
            for it, d in frag.done:
                d.copy_(narrow_tensor_by_index(value, it.dest_offsets, it.lengths))
        return frag.done

    def _compare(self, a: str, b: str, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Raise unless the two copies hold the same bytes (also once another fragment of the tensor differed)."""
        differ = (_bytes(x) != _bytes(y)).any(dim=1)
        n = int(differ.sum())
        if not n and a not in self._failed:
            return
        self._failed.add(a)
        box = self._boxes[b][i]
        if n:
            at = torch.unravel_index(differ.nonzero()[0, 0], x.shape) if x.dim() else ()
            where = tuple(o + int(j) for o, j in zip(box.offsets, at))
            found = f"{n} of {x.numel()} values differ, the first at index {where}"
        else:
            found = "another piece of them differs"
        why = f"the checkpoint holds different values for them (compared when read, no checksums showing it: {found})"
        raise tie_error(a, b, self._atoms[a], self._atoms[b], why)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, one row per element (NaN payloads and -0.0 count)."""
    return t.reshape(-1).view(torch.uint8).view(t.numel(), t.element_size())
