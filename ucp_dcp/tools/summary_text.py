"""The human tables of ``inspect``: one checkpoint's summary (:func:`format_summary`) and a torchtitan
folder's steps (:func:`format_steps`), from the dicts :mod:`ucp_dcp.tools.summary` builds."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .values import TENSOR_ELEMS, VALUE_BYTES, _cut

_HP_ORDER = ("lr", "betas", "momentum", "weight_decay", "eps")


def _mesh_text(mesh: dict[str, Any]) -> str:
    """``mesh (2, 2) dp,tp``; ``mesh (4,)`` without dim names."""
    shape = tuple(int(s) for s in mesh.get("shape", ()))
    names = mesh.get("dim_names")
    return f"mesh {shape}" + (f" {','.join(map(str, names))}" if names else "")


def _ranks_text(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _topology_text(topo: dict[str, Any] | None) -> str:
    """``world_size=4, mesh (2, 2) dp,tp`` (several meshes: numbered, with their ranks)."""
    if not topo:
        return "unknown (no ucp_dcp catalog; written by another planner)"
    meshes = topo.get("meshes") or []
    text = f"world_size={topo.get('world_size')}"
    if not meshes:
        return text + ", no device mesh (plain tensors only)"
    if len(meshes) == 1:
        return f"{text}, {_mesh_text(meshes[0])}"
    parts = [
        f"{_mesh_text(m).replace('mesh ', f'mesh{i} ', 1)}"
        + (f" on ranks {_ranks_text(m['ranks'])}" if m.get("ranks") else "")
        for i, m in enumerate(meshes)
    ]
    return f"{text}, {len(meshes)} meshes: " + "; ".join(parts)


def _group_label(g: dict[str, Any]) -> str:
    name = g["prefix"]
    if g["form"] == "group" and len(g["members"]) == 1:
        name = f"{name}.{g['members'][0]}"  # one group index of a nested optimizer
    n = len(g["params"]) if g["params"] is not None else "?"
    return f"{name} ({n} param{'' if n == 1 else 's'})"


def _group_text(g: dict[str, Any], same: set[str]) -> str:
    """``lr=0.01 betas=(0.9, 0.95) ... (+N more)  params: a, b, +N more``: the common hyperparameters
    and those that differ between the optimizer's groups; ``same`` (equal in every group) are counted."""
    shown = [(hp, t) for hp, t in g["texts"].items() if hp in _HP_ORDER or hp not in same]
    hps = " ".join(f"{hp}={_cut(t, 30)}" for hp, t in shown)
    if len(shown) < len(g["texts"]):
        hps += f" (+{len(g['texts']) - len(shown)} more, equal in every group)"
    params = g["params"] or []
    names = ", ".join(params[:3]) + (f", +{len(params) - 3} more" if len(params) > 3 else "")
    return hps + (f"  params: {names}" if names else "")


def _same_in_all(folds: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Per optimizer (prefix): the hyperparameters with one text in all its groups."""
    by_prefix: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for g in folds:
        by_prefix[g["prefix"]].append(g)
    out = {}
    for prefix, gs in by_prefix.items():
        hps = set.intersection(*(set(g["texts"]) for g in gs))
        out[prefix] = {hp for hp in hps if len({g["texts"][hp] for g in gs}) == 1}
    return out


# -- human output -----------------------------------------------------------------------------------


def format_summary(s: dict[str, Any], *, all_rows: bool = False) -> str:
    """The summary as text: a header, then one line per atom (``param_group`` rows folded into one
    line per group of values unless ``all_rows``), then value errors if any."""
    lines = []
    topo = s["topology"]
    lines.append(f"source topology: {s.get('topology_text') or _topology_text(topo)}")
    if topo:
        lines.append(f"catalog v{s['catalog_version']} written by {s['writer']}")
    lines.append(f"{len(s['atoms'])} atoms, {s['total_bytes'] / 2**20:.2f} MiB in data files")
    if s.get("integrity"):
        lines.append(f"integrity: {s['integrity']['summary']}")
    if s.get("values_read"):
        checked = (s.get("integrity") or {}).get("algo")
        lines.append(
            f"values: objects up to {VALUE_BYTES} bytes"
            + (
                f" and tensors up to {TENSOR_ELEMS} elements, verified against their checksums"
                if checked
                else ", unverified (no checksums; tensor values not shown)"
            )
            + "; decoded without running code"
        )
    folds = [] if all_rows else s.get("param_groups") or []
    folded = {n: g for g in folds for n in g["atoms"]}
    same = _same_in_all(folds)
    rows: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = []
    placed = set()
    for name, r in s["atoms"].items():
        g = folded.get(name)
        if g is None:
            rows.append((name, r, None))
        elif id(g) not in placed:
            placed.add(id(g))
            rows.append((_group_label(g), None, g))
    w = max((len(n) for n, _, _ in rows), default=4)
    lw = max([6] + [len(" ".join(r["layouts"])) for _, r, _ in rows if r is not None])
    lines.append(
        f"{'atom':<{w}}  {'shape':<16} {'dtype':<9} {'kind':<11} {'pattern':<10} {'chunks':>6} {'bytes':>10}  "
        f"{'layout':<{lw}}  value"
    )
    for name, r, g in rows:
        if g is not None:
            pattern = {s["atoms"][n]["pattern"] for n in g["atoms"]}
            lines.append(
                f"{name:<{w}}  {'-':<16} {'-':<9} {'param_group':<11} "
                f"{pattern.pop() if len(pattern) == 1 else 'mixed':<10} {len(g['atoms']):>6} "
                f"{g['bytes']:>10}  {'':<{lw}}  {_group_text(g, same[g['prefix']])}".rstrip()
            )
            continue
        shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
        shape = shape or "scalar"
        layout = " ".join(r["layouts"])
        value = _cut(r["value_text"]) if r.get("value_text") else ""
        live = f"  <- {r['live']}" if r.get("live") else ""  # the live tensor this atom is a part of
        lines.append(
            f"{name:<{w}}  {shape:<16} {r['dtype'] or '-':<9} {r['kind']:<11} {r['pattern']:<10} {r['chunks']:>6} "
            f"{r['bytes']:>10}  {layout:<{lw}}  {value}".rstrip()
            + live
        )
    if folds:
        n = sum(len(g["atoms"]) for g in folds)
        lines.append(f"({n} param_group rows folded into {len(folds)} line(s); --all shows every row)")
    errors = [(n, r["value_error"]) for n, r in s["atoms"].items() if r.get("value_error")]
    refused = [(n, r["value_refused"]) for n, r in s["atoms"].items() if r.get("value_refused")]
    if errors:
        lines.append(
            f"value errors ({len(errors)}): the checkpoint is damaged; `python -m ucp_dcp verify` checks every byte"
        )
        lines.extend(f"  {n}: {msg}" for n, msg in errors)
    if refused:
        lines.append(f"values not decoded ({len(refused)}):")
        lines.extend(f"  {n}: {msg}" for n, msg in refused)
    return "\n".join(lines)


def _writer_text(row: dict[str, Any]) -> str:
    w = row.get("writer")
    if w:
        return f"ucp_dcp {w.get('ucp_dcp', '?')}"
    return "another planner" if "atoms" in row else "-"


def format_steps(d: dict[str, Any]) -> str:
    """The step listing as text: one line per step, the latest marked."""
    steps = d["steps"]
    latest = d["latest"]
    lines = [
        f"torchtitan checkpoint folder {d['folder']}: {len(steps)} step(s), "
        + (f"latest step {latest} (torchtitan resumes from it)" if latest is not None else "none committed")
    ]
    sw = max([4] + [len(str(r["step"])) for r in steps])
    lines.append(f"{'step':>{sw}}  {'integrity':<10} {'atoms':>6} {'MiB':>9}  {'writer':<16} topology")
    for r in steps:
        if "atoms" in r:
            rest = f"{r['atoms']:>6} {r['total_bytes'] / 2**20:>9.2f}  {_writer_text(r):<16} {r['topology_text']}" + (
                f" ({r['strays']} stray file(s))" if r.get("strays") else ""
            )
        else:
            why = (
                "no .metadata: a save that did not commit (torchtitan skips it)"
                if r["status"] == "incomplete"
                else _cut(r["error"], 100)
            )
            rest = f"{'-':>6} {'-':>9}  {'-':<16} {why}"
        lines.append(f"{r['step']:>{sw}}  {r['status']:<10} {rest}" + ("  <- latest" if r["latest"] else ""))
    if steps:
        show = latest if latest is not None else steps[-1]["step"]
        lines.append(f"one step in full: python -m ucp_dcp inspect {d['folder']} --step {show}")
    return "\n".join(lines)
