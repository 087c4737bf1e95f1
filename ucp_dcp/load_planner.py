"""``UCPLoadPlanner``: turns the target's fragments into reads of saved chunks of the same atoms."""

from __future__ import annotations

import difflib
import functools
import io
import logging
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    STATE_DICT_TYPE,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ._compat import _init_state_dict, narrow_tensor_by_index, set_element
from .catalog import read_catalog
from .coverage import ChunkIndex, exact_cover_problem
from .errors import (
    CoverageError,
    DtypeConversionError,
    MissingAtomsError,
    ParamGroupError,
    ShapeMismatchError,
    UCPError,
    UnsafeCheckpointError,
    UnverifiedCheckpointWarning,
)
from .fragments import Box
from .naming import AtomName, NameRules, OptimizerForm
from .options import UCPOptions, split_options
from .patterns import Patterns, rule_from_json
from .checks import check_rules_and_ownership, zero_like
from .resolve import Resolved, Resolver
from .device import needs_staging, split_reads, staging_forced
from .entries import Entry, GroupTarget

__all__ = ["UCPLoadPlanner"]

logger = logging.getLogger(__name__)

_GROUP_SINK = "\x00ucp-param-group"


class UCPLoadPlanner(DefaultLoadPlanner):
    """Load planner that fills any target layout from the atoms of a checkpoint.

    Args:
        options: the layout description shared with the save planner (:class:`UCPOptions`:
            ``patterns`` for the *target* layout — the rules recorded in the checkpoint's catalog
            apply too —, ``strict``, ``stage_map``, ``expert_map``, ``name_rules`` (as at save),
            ``data_slot``: for ``Reduce(op="sum")`` the ranks of slot 0 receive the total and the
            others 0; default only the coordinator), or those fields as keyword arguments.
        read_once: saved bytes several ranks need (replicas) are read by one rank the coordinator
            picks and sent to the others by ``UCPFileSystemReader``. ``"hosts"`` (default): only
            ranks on *other* hosts receive them; ranks on the reader's host read for themselves,
            since that host's page cache already holds the bytes (on one machine nothing is sent).
            ``"ranks"``: every other rank receives them. ``"off"``: every rank reads what it needs.
            ``True``/``False`` mean ``"ranks"``/``"off"``. The host is ``socket.gethostname()``,
            or ``UCP_DCP_HOST`` when set (to simulate several hosts on one machine).
        allow_partial_load: skip atoms the checkpoint lacks instead of raising
            :class:`MissingAtomsError` (they are listed in ``planner.missing_atoms``).
        allow_lossy_dtype: load atoms into targets of a dtype that loses values, the way
            ``Tensor.copy_`` converts (float -> int truncates, complex -> real drops the imaginary
            part, values outside the target's range wrap or become inf). By default such loads
            raise :class:`DtypeConversionError`: kind changes at planning, before any byte is read,
            out-of-range values when the data is read. Widening and precision-only conversions
            (fp32 -> bf16 in range, int32 -> int64, int -> float) are always allowed.
        trust: decode non-tensor values with a full unpickle. By default they are decoded with
            ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts, tuples and
            the types registered with ``torch.serialization.add_safe_globals``; anything else is
            refused with :class:`UnsafeCheckpointError`, since unpickling it could run code.
    """

    def __init__(
        self,
        options: UCPOptions | None = None,
        *,
        read_once: str | bool = "hosts",
        allow_partial_load: bool = False,
        allow_lossy_dtype: bool = False,
        trust: bool = False,
        **layout: Any,
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        self.options = split_options(options, layout)
        self._config = {"read_once": read_once, "allow_partial_load": allow_partial_load,
                        "allow_lossy_dtype": allow_lossy_dtype, "trust": trust}
        self.allow_lossy_dtype = bool(allow_lossy_dtype)
        self.trust = bool(trust)
        self.read_once = {True: "ranks", False: "off"}.get(read_once, read_once) if isinstance(read_once, bool) else read_once
        if self.read_once not in ("hosts", "ranks", "off"):
            raise UCPError(f"read_once={read_once!r}: expected 'hosts', 'ranks' or 'off'")
        self.missing_atoms: list[str] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.options, self._config))  # configuration only (see UCPSavePlanner)

    name_rules = property(lambda self: self.options.name_rules)
    rules = property(lambda self: self.options.patterns)
    strict = property(lambda self: self.options.strict)
    maps = property(lambda self: self.options.maps)
    data_slot = property(lambda self: self.options.data_slot)

    def set_up_planner(
        self, state_dict: STATE_DICT_TYPE, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise UCPError("no checkpoint metadata to plan against")
        if getattr(metadata, "_ucp_error", None) is not None:  # UCPFileSystemReader could not open it
            raise metadata._ucp_error  # type: ignore[attr-defined]
        _init_state_dict(state_dict)
        self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        if is_coordinator and getattr(metadata, "_ucp_integrity", None) is None:
            warnings.warn(
                "this load reads through a storage reader that verifies no checksums and unpickles the "
                "checkpoint's metadata: use ucp_dcp.load(state, path) or storage_reader=UCPFileSystemReader(path)",
                UnverifiedCheckpointWarning, stacklevel=2)
        self._catalog = read_catalog(metadata.planner_data)  # refuses newer catalogs before any read
        saved_rules = [rule_from_json(d) for d in (self._catalog or {}).get("rules", [])]
        self._patterns = Patterns(self.rules, strict=self.strict).merged(saved_rules)
        self._resolver = Resolver(self.name_rules, self._patterns, self.maps)
        resolved, self._groups = self._resolver.resolve_state_dict(state_dict, for_load=True)
        self._targets: dict[str, Resolved] = {r.entry.key: r for r in resolved}
        self.state_dict = {r.entry.key: r.value for r in resolved}
        self.mappings = {r.entry.key: r.entry.path for r in resolved}

    # -- planning --------------------------------------------------------------------------------

    def create_local_plan(self) -> LoadPlan:
        saved = _SavedIndex(self.metadata, self.name_rules)
        self._sinks: dict[str, Callable[[Any], None]] = {}
        self._zero: list[Resolved] = []
        self.missing_atoms = []
        reads: list[ReadItem] = []
        problems: list[UCPError] = []
        for r in self._targets.values():
            if not r.present:
                continue
            keeps_total = self.is_coordinator if self.data_slot is None else self.data_slot == 0
            if r.reduce is not None and r.reduce.op == "sum" and not keeps_total:
                self._zero.append(r)  # the coordinator takes the total; the next save sums right
                continue
            try:
                reads.extend(self._plan_entry(r, saved))
            except UCPError as err:
                problems.append(err)
        for g in self._groups:
            try:
                reads.extend(self._plan_group(g, saved))
            except UCPError as err:
                problems.append(err)
        if self.missing_atoms and not self.allow_partial_load:
            problems.insert(0, _missing_error(self.missing_atoms, saved))
        elif self.missing_atoms:
            logger.warning("UCP partial load: %d atom(s) not in the checkpoint were left as they are: %s",
                           len(self.missing_atoms), ", ".join(self.missing_atoms[:10]))
        if problems:
            raise _combine(problems)
        self._patterns.note_names(_saved_names(self.metadata, self._catalog))
        # reads into device targets are cut to the staging buffer's size (bounded host memory,
        # also for pieces other ranks send)
        forced = staging_forced()
        reads = split_reads(reads, lambda it: _itemsize(self.metadata, it),
                            lambda it: needs_staging(self._targets[it.dest_index.fqn].local, forced))
        self._reads = reads
        summary: dict[str, Any] = {
            "used": sorted(self._patterns.used),
            "claims": [c for r in self._targets.values() for c in r.index_claims],
            "map_totals": {m.key: m.total for m in self.maps},
            # for the storage layer: who reads shared bytes, and that finish_plan puts the items
            # back (a reader may leave them out of the gathered plan; only summaries travel)
            "read_once": self.read_once,
            "keeps_items": True,
        }
        return LoadPlan(reads, planner_data=summary)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        pds = [p.planner_data or {} for p in global_plan]
        check_rules_and_ownership(self._patterns, pds, {m.key: m.total for m in self.maps}, "at load")
        # what the storage layer asked for stays with each plan (its prepare_global_plan reads it)
        return [LoadPlan([], storage_data=p.storage_data) for p in global_plan]

    def _plan_entry(self, r: Resolved, saved: "_SavedIndex") -> list[ReadItem]:
        if r.unsplit is not None and not any(saved.lookup(a) for a in r.atoms) and saved.lookup(r.name):
            # fused parts absent but the fused tensor itself was saved (stock DCP / torchtitan): its
            # block layout does not depend on the parallel layout, so load it as one atom
            r.fragments = r.unsplit
            r.atoms = {r.name: {**next(iter(r.atoms.values())), "shape": list(r.value.shape)
                                if isinstance(r.value, torch.Tensor) else None}}
            r.fanout = False
        e = r.entry
        names = list(r.atoms)[:1] if r.fanout else list(r.atoms)
        keys = {}
        for name in names:
            skey = saved.lookup(name)
            if skey is None:
                self.missing_atoms.append(name)
            else:
                keys[name] = skey
        if len(keys) < len(names):
            return []
        if not e.is_tensor:
            (name, skey), = keys.items()
            if not isinstance(saved.md.state_dict_metadata[skey], BytesStorageMetadata):
                smd = saved.md.state_dict_metadata[skey]
                raise ShapeMismatchError(
                    f"atom '{name}' was saved as a tensor of shape {tuple(smd.size)} but the target "
                    f"holds a {type(e.value).__name__}",
                    atom=name, saved=tuple(smd.size), wanted=type(e.value).__name__,
                    hint="put a tensor in the target state dict for this key",
                )
            self._sinks[e.key] = lambda v, path=e.path: set_element(self.original_state_dict, path, v)
            return [_bytes_read(e.key, skey)]
        for name, skey in keys.items():
            _check_tensor(name, saved.md.state_dict_metadata[skey], r, self.allow_lossy_dtype)
        reads = []
        for i, f in enumerate(r.fragments):
            if f.atom not in keys:
                continue
            skey = keys[f.atom]
            index = saved.chunks(skey)
            pieces = index.overlaps(f.box)
            problem = exact_cover_problem(f.box, [ov for _, ov in pieces])
            if problem:
                have = tuple(saved.md.state_dict_metadata[skey].size)
                raise CoverageError(
                    f"atom '{f.atom}' (saved shape {have}, wanted shape {tuple(r.atoms[f.atom]['shape'])}): "
                    f"wanted box {f.box} is not covered exactly once by the saved chunks: {problem}",
                    atom=f.atom, saved=have, wanted=str(f.box),
                    hint="the checkpoint is incomplete or was written by a planner that mislabels "
                    "non-contiguous shards (stock DCP with _StridedShard); re-save it with UCPSavePlanner",
                )
            for ci, ov in pieces:
                chunk = index.boxes[ci]
                reads.append(ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(e.key, f.box.offsets, i),
                    dest_offsets=torch.Size(ov.shift(f.box.offsets).offsets),
                    storage_index=MetadataIndex(skey, chunk.offsets, ci),
                    storage_offsets=torch.Size(ov.shift(chunk.offsets).offsets),
                    lengths=torch.Size(ov.sizes),
                ))
        return reads

    def _group_atom(self, g: GroupTarget, param: str, hp: str) -> str:
        """The atom holding hyperparameter ``hp`` of ``param`` (after tie and fused resolution)."""
        name = AtomName(tuple(g.prefix) + ("param_groups",), param, (hp,), "param_group", form=OptimizerForm.NESTED)
        r = self._resolver.resolve(Entry(name.name, name, None, name.path))
        return next(iter(r.atoms))

    def _plan_group(self, g: GroupTarget, saved: "_SavedIndex") -> list[ReadItem]:
        reads = []
        for hp in g.hyperparams:
            sink_key = f"{_GROUP_SINK}:{id(g)}:{hp}"
            atoms = {p: self._group_atom(g, p, hp) for p in g.params}
            found = {p: saved.lookup(a) for p, a in atoms.items()}
            if g.params and all(k is not None for k in found.values()):
                collector = _GroupCollector(g, hp, len(g.params), atoms)
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
            self.missing_atoms.extend(atoms[p] for p, k in found.items() if k is None)
        return reads

    # -- data ------------------------------------------------------------------------------------

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        new_plan = LoadPlan(self._reads, storage_data=new_plan.storage_data, planner_data=new_plan.planner_data)
        # the load is validated on every rank: now it is safe to touch the target
        with torch.no_grad():
            for r in self._targets.values():
                for box in r.fills:
                    region = r.local
                    for d, (o, n) in enumerate(zip(box.offsets, box.sizes)):
                        region = region.narrow(d, o, n)
                    region.fill_(r.fill_value)
            for r in self._zero:
                if isinstance(r.value, torch.Tensor):
                    r.local.zero_()
                else:
                    set_element(self.original_state_dict, r.entry.path, zero_like(r.value))
        return new_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._sinks[read_item.dest_index.fqn](decode_value(value, read_item.storage_index.fqn, self.trust))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._target_region(read_item)
        saved = self.metadata.state_dict_metadata[read_item.storage_index.fqn].properties.dtype
        if saved == target.dtype or self.allow_lossy_dtype or _conversion(saved, target.dtype) != "range":
            return target  # the reader writes (and converts) straight into the target
        # a narrowing conversion: read into a scratch tensor of the saved dtype, range-check the
        # values in commit_tensor, then convert into the target
        return torch.empty(tuple(read_item.lengths), dtype=saved)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = self._target_region(read_item)
        if tensor.dtype == target.dtype:
            return  # the target itself (see resolve_tensor)
        r = self._targets[read_item.dest_index.fqn]
        _check_range(r.fragments[read_item.dest_index.index].atom, tensor, target.dtype)
        with torch.no_grad():
            target.copy_(tensor)

    def _target_region(self, read_item: ReadItem) -> torch.Tensor:
        r = self._targets[read_item.dest_index.fqn]
        region = r.fragments[read_item.dest_index.index].view(r.local)
        return narrow_tensor_by_index(region, read_item.dest_offsets, read_item.lengths)


def decode_value(data: io.BytesIO, atom: str, trust: bool = False) -> Any:
    """A saved non-tensor value, decoded with a closed set of types unless ``trust``."""
    if trust:
        return torch.load(data, weights_only=False)
    try:
        return torch.load(data, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported operand|Trying to [^.]*)[^\n.]*", str(e))
        first = found.group(0).strip() if found else type(e).__name__
        raise UnsafeCheckpointError(
            f"value of atom '{atom}' holds a type outside the safe set (tensors, numbers, strings, lists, dicts, "
            f"tuples, ...): decoding it could run code ({first})",
            atom=atom, saved="pickled object",
            hint="if you trust where this checkpoint came from, load with trust=True (ucp_dcp.load(..., trust=True) "
            "or UCPLoadPlanner(trust=True)), or allow the type with torch.serialization.add_safe_globals([...])",
        ) from None


def _itemsize(md: Metadata, item: ReadItem) -> int:
    return md.state_dict_metadata[item.storage_index.fqn].properties.dtype.itemsize


def _check_tensor(name: str, smd: Any, r: Resolved, allow_lossy_dtype: bool = False) -> None:
    want = tuple(r.atoms[name]["shape"])
    if not isinstance(smd, TensorStorageMetadata):
        raise ShapeMismatchError(
            f"atom '{name}' was saved as a non-tensor object but the target holds a tensor of shape {want}",
            atom=name, saved="object", wanted=want,
            hint="put the same kind of value in the target state dict as was saved",
        )
    have = tuple(int(s) for s in smd.size)
    if want != have:
        raise ShapeMismatchError(
            f"atom '{name}': saved shape {have}, wanted shape {want}. {_likely_cause(have, want, r.value)}",
            atom=name, saved=have, wanted=want,
            hint="load into a model built with the saved configuration, or declare a pattern "
            "(Padded/Fused) that maps the two shapes",
        )
    saved, wanted = smd.properties.dtype, r.local.dtype
    if not allow_lossy_dtype and saved != wanted and _conversion(saved, wanted) == "lossy":
        raise DtypeConversionError(
            f"atom '{name}': saved dtype {saved}, wanted dtype {wanted}: converting would "
            f"{_LOSS[(_kind(saved), _kind(wanted))] if wanted != torch.bool else 'turn every value into True/False'}",
            atom=name, saved=saved, wanted=wanted,
            hint=f"load into a tensor of dtype {saved} and convert it yourself, or pass "
            "UCPLoadPlanner(allow_lossy_dtype=True) to convert the way Tensor.copy_ does",
        )


# -- dtype conversions ---------------------------------------------------------------------------
# A conversion is "lossy" when the kind drops (complex > float > int > bool: the fraction, imaginary
# part or magnitude is lost for ordinary values), "range" when the kind is kept or widened but some
# saved values may not fit the target (int64 -> int32, fp32 -> fp16/bf16: checked value by value
# at read), and "safe" when every saved value fits (precision may still drop: fp32 -> bf16 rounds).

_LOSS = {
    (3, 2): "drop the imaginary parts", (3, 1): "drop the imaginary parts and truncate the fractions",
    (2, 1): "truncate the fractions (1.7 -> 1)",
}


def _kind(dtype: torch.dtype) -> int | None:
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    try:
        torch.iinfo(dtype)
    except (TypeError, RuntimeError):
        return None  # quantized, sub-byte and other exotic dtypes: converted as torch does
    return 1


def _limits(dtype: torch.dtype) -> tuple[float, float]:
    """Smallest and largest finite value (the real part's, for complex dtypes)."""
    info = torch.iinfo(dtype) if _kind(dtype) == 1 else torch.finfo(dtype)
    return info.min, info.max


@functools.lru_cache(maxsize=None)
def _conversion(saved: torch.dtype, wanted: torch.dtype) -> str:
    """``"safe"``, ``"range"`` (values must be checked) or ``"lossy"`` for saved -> wanted."""
    ks, kw = _kind(saved), _kind(wanted)
    if saved == wanted or ks is None or kw is None or ks == 0:
        return "safe"
    if kw < ks:
        return "lossy"
    (slo, shi), (wlo, whi) = _limits(saved), _limits(wanted)
    return "safe" if wlo <= slo and shi <= whi else "range"


def _check_range(atom: str, src: torch.Tensor, wanted: torch.dtype) -> None:
    """Refuse saved values ``src`` that do not fit ``wanted`` (inf/NaN stay inf/NaN and pass)."""
    if not src.numel():
        return
    values = torch.view_as_real(src) if src.is_complex() else src
    lo, hi = _limits(wanted)
    if _kind(wanted) == 1:
        bad = (values < lo) | (values > hi)
    else:
        bad = ((values < -hi) | (values > hi)) & values.isfinite()
    if not bool(bad.any()):
        return
    example = values[bad].reshape(-1)[0].item()
    how = "wrap around" if _kind(wanted) == 1 else "become inf"

    def fmt(v: float) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    raise DtypeConversionError(
        f"atom '{atom}': saved dtype {src.dtype}, wanted dtype {wanted}: {int(bad.sum())} saved value(s) "
        f"are outside {wanted}'s range [{fmt(lo)}, {fmt(hi)}] (e.g. {fmt(example)}) and would {how}",
        atom=atom, saved=src.dtype, wanted=wanted,
        hint=f"load into a tensor of dtype {src.dtype} (or a wider one) and convert it yourself, or pass "
        "UCPLoadPlanner(allow_lossy_dtype=True) to convert the way Tensor.copy_ does",
    )


def _saved_names(md: Metadata, catalog: dict[str, Any] | None) -> set[str]:
    names = set(md.state_dict_metadata)
    for name, rec in (catalog or {}).get("atoms", {}).items():
        names.update(x for x in (rec.get("param"), rec.get("live")) if x)
    return names


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
            if not _same(v, v0):
                raise ParamGroupError(
                    f"param group {self.g.index} of '{'.'.join(map(str, self.g.prefix))}': "
                    f"'{self.hp}' is {v0!r} for '{p0}' but {v!r} for '{p}' in the checkpoint",
                    atom=self.atoms[p], saved={p0: v0, p: v}, wanted=f"one value for group {self.g.index}",
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


def _rebuild(cls: type, options: UCPOptions, config: dict[str, Any]) -> Any:
    return cls(options, **config)
