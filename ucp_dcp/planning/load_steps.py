"""Load planning, as pure steps: the saved index, the reads that fill each target entry and param
group, the checks on what was saved, and the errors that explain a failed plan.

:class:`ucp_dcp.planning.load_planner.UCPLoadPlanner` strings these together.

Kept in one module (over 400 lines once formatted): the pure steps ``UCPLoadPlanner`` strings
together share the saved index (:class:`SavedIndex`) and the read-item builders; as DCP's
``default_planner.py`` keeps its steps beside each other.
"""

from __future__ import annotations

import difflib
import importlib
import io
import pickle
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..errors import (
    CoverageError,
    DtypeConversionError,
    MissingAtomsError,
    ParamGroupError,
    ShapeMismatchError,
    UCPError,
    UnsafeCheckpointError,
)
from ..layout.coverage import ChunkIndex, exact_cover_problem
from ..layout.dtypes import LOSS, conversion, kind
from ..layout.fragments import Box
from ..layout.naming import AtomName, NameRules, OptimizerForm
from .catalog import load_catalog
from .catalog_record import Catalog
from .entries import Entry, GroupTarget
from .resolve import Resolved, Resolver
from .ties import catalog_aliases, saved_equal

__all__ = [
    "GROUP_SINK",
    "SavedIndex",
    "GroupCollector",
    "entry_reads",
    "use_unsplit",
    "group_reads",
    "bytes_read",
    "check_tensor",
    "decode_value",
    "itemsize",
    "saved_names",
    "missing_error",
    "combine_problems",
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
