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

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import AmbiguousLayoutError, PatternError, UCPError
from ..layout.patterns import Rule, Tied, describe, rule_to_json
from .entries import local_tensor

__all__ = ["with_map_note", "tie_problem", "alias_problems", "rule_conflicts", "reduce_problem"]

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


def tie_problem(r: Any, saved_lookup: Any, saved_rules: Sequence[Rule], rules: Sequence[Rule]) -> UCPError | None:
    """A target entry a ``Tied`` rule renamed to another parameter's atom, while the checkpoint
    holds the entry's own atom and was not saved with that tie: loading the tied atom would replace
    the saved values (``rules``: this load's declared rules)."""
    own = r.entry.atom
    if not r.tied or own.param == r.atom.param:
        return None
    rule = next((x for x in rules if isinstance(x, Tied) and x.param == r.atom.param), None)
    if rule is None or rule in saved_rules or saved_lookup(own.name) is None:
        return None
    return PatternError(
        f"rule {describe(rule)} (declared at load, not at save) loads '{r.atom.name}' into '{r.entry.key}', "
        f"but the checkpoint holds '{own.name}' as an atom of its own: its saved values would be replaced",
        atom=own.name,
        saved=f"'{own.name}' and '{r.atom.name}' saved separately",
        wanted=f"tied to '{r.atom.param}'",
        hint="drop the Tied rule at load to load each saved atom into its own parameter (the model then "
        "starts untied), or save the job with the tie declared",
    )


def alias_problems(resolved: Sequence[Any]) -> list[UCPError]:
    """Target keys whose local memory overlaps but which load different atoms."""
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
    for items in spans.values():
        items.sort(key=lambda x: x[0])
        for (_lo1, hi1, a), (lo2, _hi2, b) in zip(items, items[1:]):
            if lo2 < hi1 and not set(a.atoms) & set(b.atoms):
                out.append(
                    AmbiguousLayoutError(
                        f"target keys '{a.entry.key}' and '{b.entry.key}' share memory but load different atoms "
                        f"({sorted(a.atoms)[0]!r} and {sorted(b.atoms)[0]!r}): one load would overwrite the other",
                        atom=sorted(b.atoms)[0],
                        saved=[sorted(a.atoms)[0], sorted(b.atoms)[0]],
                        wanted="one value",
                        hint="if they are one tied parameter, declare Tied(<param>, [<alias>]) at save and load (its "
                        "copies are then one atom); otherwise give each key its own tensor",
                    )
                )
    return out


_LAYOUT_FIELDS = {
    "fused": ("parts", "dim", "blocks"),
    "tied": ("param", "aliases"),
    "reduce": ("op",),
    "padded": ("size", "dim"),
}
"""The fields of a rule that decide how saved atoms relate to live values (not ``fill``, ``check``)."""


def rule_conflicts(
    declared: Sequence[Rule], saved_rules: Sequence[Rule], catalog: dict[str, Any] | None
) -> list[UCPError]:
    """Rules this load declares that describe a parameter the checkpoint holds differently from the
    rule it was saved with (same kind, both match one saved name, other layout fields): the saved
    atoms were cut by the saved rule, so the declared one would put their rows in the wrong places."""
    import re

    atoms = (catalog or {}).get("atoms", {})
    names: set[str] = set()
    for name, rec in atoms.items():
        names.update(x for x in (rec.get("param"), rec.get("live"), name) if x)
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


def reduce_problem(r: Any, catalog: dict[str, Any] | None) -> UCPError | None:
    """A ``Reduce`` rule applied at load to an atom the checkpoint saved without one: what was saved
    is one rank's copy (checked equal across ranks), which the load would take for the reduced total."""
    if r.reduce is None or not catalog:
        return None
    rec = catalog.get("atoms", {}).get(r.name)
    if rec is None or str(rec.get("pattern", "")).startswith("reduce:"):
        return None
    return PatternError(
        f"rule {describe(r.reduce)} reduces '{r.name}' at load, but the checkpoint saved it without a reduction "
        f"(pattern {rec.get('pattern')!r}: one rank's copy): the load would take that copy for the {r.reduce.op}",
        atom=r.name,
        saved=rec.get("pattern"),
        wanted=f"reduce:{r.reduce.op}",
        hint="declare the Reduce rule at save too (the save then reduces every rank's value), or load without it",
    )
