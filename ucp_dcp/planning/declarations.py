"""A load's declarations checked against what the checkpoint and the target state hold.

The rules and maps a load passes describe the *target*; the catalog records what was declared at
save. Where the two disagree in a way that changes meaning, the load is refused before a byte is
read: a map the checkpoint was saved with and this load lacks (its stage-local names then miss or
collide; on plain tensors :mod:`ucp_dcp.planning.forgotten_maps` sees it at the global plan), a
``Tied`` rule declared only at load over an atom the checkpoint holds separately (its saved values
would be replaced by the tied parameter's), and target keys that alias one storage under different
atoms (one of the two loads would silently overwrite the other).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import AmbiguousLayoutError, PatternError, UCPError
from ..layout.patterns import Rule, Tied, describe, rule_to_json
from .catalog import RAW_HINT, raw_optimizer_error
from .catalog_record import Catalog
from .entries import local_tensor
from .ties import storage_identity

__all__ = [
    "with_map_note",
    "tie_problem",
    "alias_problems",
    "tie_error",
    "rule_conflicts",
    "reduce_problem",
    "raw_optimizer_problems",
    "check_raw_params",
    "raw_params_sink",
    "with_raw_note",
]

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
    loads. Both copies are then read and compared when read (:mod:`ucp_dcp.planning.tie_reads`)."""
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
    (``why``): refused at plan time, or when read (:mod:`ucp_dcp.planning.tie_reads`)."""
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
