"""Summaries of a DCP checkpoint: source topology and per-atom shape, dtype, kind, chunks, bytes and,
for small values, the value itself; and of a torchtitan ``checkpoint/`` folder of ``step-N`` checkpoints.

Works on any DCP checkpoint; without a ucp_dcp catalog the topology is reported as unknown. Kinds
(``model``, ``optim_state``, ``param_group``, ``optim``, ``train_state``, ``scheduler``,
``dataloader``, ``rng``, ``object``) come from the catalog for optimizer entries and from the
atom's name otherwise (torchtitan saves model weights at the top level, ``tok_embeddings.weight``).

Nothing here runs code from the checkpoint: metadata is opened by
:func:`ucp_dcp.storage.commit.open_checkpoint`; a value is read only when small (objects up to
:data:`VALUE_BYTES`, tensors up to :data:`TENSOR_ELEMS` elements), checked against the checkpoint's
checksum when it has one (a mismatch is reported, the value is not shown), and decoded with
``torch.load(weights_only=True)``; a value holding any other type is refused, not decoded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointNotFoundError, IncompleteCheckpointError, UCPError
from ..planning.catalog import load_catalog, read_catalog
from ..planning.ties import catalog_aliases
from ..storage.commit import Integrity, open_checkpoint, scan
from ..storage.opening import filesystem, step_folders
from .summary_text import _HP_ORDER, _mesh_text, _topology_text, format_steps, format_summary
from .values import TENSOR_ELEMS, VALUE_BYTES, read_values

__all__ = [
    "summarize",
    "atom_kinds",
    "fold_param_groups",
    "summarize_steps",
    "read_values",
    "format_summary",
    "format_steps",
    "VALUE_BYTES",
    "TENSOR_ELEMS",
]

# -- kinds ------------------------------------------------------------------------------------------

_TOP_KINDS = (
    (re.compile(r"(lr_?)?sched(uler)?s?"), "scheduler"),
    (re.compile(r"(train|training|trainer)(_?state)?s?"), "train_state"),
    (re.compile(r"data_?loaders?|loaders?|samplers?"), "dataloader"),
    (re.compile(r"rngs?|rng_?states?|\w+_rng(_?states?)?|random(_?state)?|generators?"), "rng"),
    (re.compile(r"optim(izer|iser)?s?"), "optim"),
    (re.compile(r"models?|modules?|ema|model_ema|net|network"), "model"),
)
"""Kind of an entry by the first segment of its name (lower case)."""
_TRAIN_SCALARS = {"step", "steps", "epoch", "global_step", "iteration", "iter", "ntokens_seen", "tokens_seen"}
"""Top-level single-segment names that are training progress."""
OPTIM_KINDS = ("optim_state", "param_group")


def atom_kinds(md: Metadata, catalog: dict[str, Any] | None = None) -> dict[str, str]:
    """Kind of every saved atom. Optimizer entries (``<prefix>.state.*`` / ``<prefix>.param_groups.*``)
    are ``optim_state`` / ``param_group`` (from the catalog when it says so, else from the names);
    the rest by their first name segment (:data:`_TOP_KINDS`): ``sched*``/``lr_scheduler*`` ->
    ``scheduler``, ``train*`` -> ``train_state``, ``dataloader*`` -> ``dataloader``, ``rng*`` ->
    ``rng``, ``model*`` -> ``model``; anything else is ``model`` for a tensor (torchtitan keeps
    weights at the top level) and ``object`` for other values."""
    cat_atoms = (catalog or {}).get("atoms", {})
    names = list(md.state_dict_metadata)
    split = {n: n.split(".") for n in names}
    optim_prefixes = {tuple(s[:i]) for s in split.values() for i, seg in enumerate(s) if seg == "param_groups"}
    out = {}
    for name in names:
        segs = split[name]
        rec_kind = cat_atoms.get(name, {}).get("kind")
        if rec_kind in OPTIM_KINDS:
            out[name] = rec_kind
            continue
        kind = None
        for p in optim_prefixes:
            n = len(p)
            if tuple(segs[:n]) == p and len(segs) > n + 1 and segs[n] in ("state", "param_groups"):
                kind = "optim_state" if segs[n] == "state" else "param_group"
                break
        if kind is None:
            head = segs[0].lower()
            kind = next((k for rx, k in _TOP_KINDS if rx.fullmatch(head)), None)
            if kind == "optim" and len(segs) > 2 and segs[1] == "state":
                kind = "optim_state"
            if kind is None and len(segs) == 1 and head in _TRAIN_SCALARS:
                kind = "train_state"
        if kind is None:
            kind = "model" if isinstance(md.state_dict_metadata[name], TensorStorageMetadata) else "object"
        out[name] = kind
    return out


# -- summary ----------------------------------------------------------------------------------------


def summarize(
    md: Metadata, integrity: Integrity | None = None, *, path: str | os.PathLike | None = None, values: bool = True
) -> dict[str, Any]:
    """Topology, integrity and one row per atom (``shape``, ``dtype``, ``kind``, ``pattern``,
    ``chunks``, ``bytes``, ``layouts``). With ``path`` (the checkpoint's folder) and ``values``,
    small atoms' rows also get ``value`` (JSON-able), ``value_text``, ``value_verified``, or
    ``value_error`` / ``value_refused`` (see :func:`read_values`). ``param_groups`` folds the
    per-(parameter, hyperparameter) rows of each optimizer into one entry per distinct group of
    values (:func:`fold_param_groups`)."""
    catalog = read_catalog(md.planner_data)
    cat_atoms = (catalog or {}).get("atoms", {})
    kinds = atom_kinds(md, catalog)
    found = read_values(path, md) if path is not None and values else {}
    aliases = catalog_aliases(load_catalog(md.planner_data))
    sizes: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
        if index.fqn not in aliases:  # an alias's entries point at its atom's bytes, stored once
            sizes[index.fqn] = sizes.get(index.fqn, 0) + int(getattr(info, "length", 0))
    atoms = {}
    for name, smd in sorted(md.state_dict_metadata.items()):
        rec = cat_atoms.get(name, {})
        if isinstance(smd, TensorStorageMetadata):
            row = {
                "shape": list(smd.size),
                "dtype": str(smd.properties.dtype).removeprefix("torch."),
                "chunks": len(smd.chunks),
            }
        else:
            row = {"shape": None, "dtype": None, "chunks": 1}
        row["kind"] = kinds[name]
        row["pattern"] = "alias" if name in aliases else rec.get("pattern", "unknown")
        if rec.get("live") or name in aliases:  # an alias: the atom whose tensor it was at save
            row["live"] = rec.get("live") or aliases[name]
        row["layouts"] = _layouts(rec, catalog)
        row["bytes"] = sizes.get(name, 0)
        got = found.get(name)
        if got:
            if "value" in got:
                row["value"] = got["value"]
                row["value_verified"] = got["verified"]
            row["value_text"] = got["text"]
            for k in ("error", "refused"):
                if k in got:
                    row[f"value_{k}"] = got[k]
        atoms[name] = row
    topo = (catalog or {}).get("topology")
    return {
        "ucp_catalog": catalog is not None,
        "catalog_version": (catalog or {}).get("version"),
        "writer": (catalog or {}).get("writer"),
        "topology": topo,
        "topology_text": _topology_text(topo),
        "dcp_version": md.version,
        "atoms": atoms,
        "total_bytes": sum(sizes.values()),
        "values_read": bool(path is not None and values),
        "value_errors": sorted(n for n, r in atoms.items() if "value_error" in r),
        "param_groups": fold_param_groups(atoms),
        "integrity": None
        if integrity is None
        else {
            "status": integrity.status,
            "sidecar": integrity.sidecar,
            "algo": integrity.algo,
            "strays": integrity.strays,
            "summary": integrity.describe(),
        },
    }


def _layouts(rec: dict[str, Any], catalog: dict[str, Any] | None) -> list[str]:
    """``mesh (2, 2) dp,tp [S(0),R]`` per distinct layout (``meshN`` when the topology has several)."""
    out = []
    meshes = (catalog or {}).get("topology", {}).get("meshes", [])
    for lay in rec.get("layouts", []):
        i = lay["mesh"]
        if i < len(meshes):
            text = _mesh_text(meshes[i])
            if len(meshes) > 1:
                text = text.replace("mesh ", f"mesh{i} ", 1)
        else:
            text = f"mesh{i} ?"
        text += f" [{','.join(lay['placements'])}]"
        if text not in out:
            out.append(text)
    return out


# -- param groups -----------------------------------------------------------------------------------


def fold_param_groups(atoms: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``param_group`` rows (``<optim>.param_groups.<member>.<hp>``: one per parameter and
    hyperparameter as ucp_dcp and ``flatten_optimizer_state_dict`` save them, or one per group
    index and hyperparameter as stock DCP saves a nested optimizer) folded into one entry per
    distinct set of hyperparameter values: ``prefix``, ``form`` (``param``: members are parameters;
    ``group``: group indices), ``members``, ``params`` (parameter names,
    None when not known), ``values`` (JSON-able), ``texts``, ``atoms`` (the folded rows), ``bytes``.

    Only members whose every hyperparameter (but a group's ``params`` list) was read, verified
    where checksummed, and decoded are folded; the rows of the others stay on their own."""
    members: dict[tuple[str, str], dict[str, str]] = {}  # (prefix, member) -> hp -> atom
    for name, row in atoms.items():
        if row["kind"] != "param_group":
            continue
        segs = name.split(".")
        if "param_groups" not in segs:
            continue
        i = segs.index("param_groups")
        if len(segs) < i + 3:
            continue
        members.setdefault((".".join(segs[: i + 1]), ".".join(segs[i + 1 : -1])), {})[segs[-1]] = name
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    per_param = {prefix for (prefix, _), hps in members.items() if "params" not in hps}
    copies: list[tuple[str, dict[str, str]]] = []
    for (prefix, member), hps in members.items():
        if any("value" not in atoms[n] for hp, n in hps.items() if hp != "params"):
            continue
        if "params" in hps and prefix in per_param:  # ucp_dcp's copy in DCP's own form, for stock readers
            copies.append((prefix, hps))
            continue
        sig = json.dumps(
            ["params" in hps] + sorted((hp, atoms[n]["value_text"]) for hp, n in hps.items() if hp != "params")
        )
        g = groups.get((prefix, sig))
        if g is None:
            g = groups[(prefix, sig)] = {
                "prefix": prefix,
                "form": "group" if "params" in hps else "param",
                "members": [],
                "params": [],
                "values": {hp: atoms[n]["value"] for hp, n in sorted(hps.items(), key=_hp_key) if hp != "params"},
                "texts": {hp: atoms[n]["value_text"] for hp, n in sorted(hps.items(), key=_hp_key) if hp != "params"},
                "atoms": [],
                "bytes": 0,
            }
        g["members"].append(member)
        if "params" in hps:  # stock DCP's nested form: the member is a group index holding its params
            listed = atoms[hps["params"]].get("value")
            if isinstance(listed, list) and g["params"] is not None:
                g["params"].extend(map(str, listed))
            else:
                g["params"] = None
        elif g["params"] is not None:
            g["params"].append(member)
        g["atoms"].extend(sorted(hps.values()))
        g["bytes"] += sum(atoms[n]["bytes"] for n in hps.values())
    for prefix, hps in copies:  # folded into the per-parameter group of the same values
        sig = json.dumps([False] + sorted((hp, atoms[n]["value_text"]) for hp, n in hps.items() if hp != "params"))
        g = groups.get((prefix, sig))
        if g is not None:
            g["atoms"].extend(sorted(hps.values()))
            g["bytes"] += sum(atoms[n]["bytes"] for n in hps.values())
    return list(groups.values())


def _hp_key(item: tuple[str, Any]) -> tuple[int, str]:
    hp = item[0]
    return (_HP_ORDER.index(hp) if hp in _HP_ORDER else len(_HP_ORDER), hp)


def summarize_steps(path: str | os.PathLike, *, trust: bool = False) -> dict[str, Any]:
    """One entry per ``step-N`` checkpoint of a torchtitan folder, by step: ``step``, ``path``,
    ``status`` (the integrity status, ``incomplete``, or ``damaged`` with ``error``), ``atoms``,
    ``total_bytes``, ``writer``, ``topology``, ``latest``. The latest is the step torchtitan
    resumes from: the highest one holding a ``.metadata``. Only metadata is read."""
    fs, root = filesystem(path)
    steps = []
    for step, name in step_folders(path) or []:
        sub = fs.concat_path(root, name)
        st = scan(fs, sub)
        row: dict[str, Any] = {
            "step": step,
            "path": str(sub),
            "committed": bool(st and st.has_metadata),
            "latest": False,
        }
        try:
            md, integrity = open_checkpoint(fs, sub, trust=trust)
            s = summarize(md, integrity)
        except (IncompleteCheckpointError, CheckpointNotFoundError) as e:
            row.update(status="incomplete", error=e.message)
        except UCPError as e:
            row.update(status="damaged", error=e.message)
        else:
            row.update(
                status=integrity.status,
                atoms=len(s["atoms"]),
                total_bytes=s["total_bytes"],
                ucp_catalog=s["ucp_catalog"],
                writer=s["writer"],
                topology=s["topology"],
                topology_text=s["topology_text"],
                strays=len(integrity.strays),
            )
        steps.append(row)
    committed = [r for r in steps if r["committed"]]
    if committed:
        committed[-1]["latest"] = True
    return {"folder": str(path), "steps": steps, "latest": committed[-1]["step"] if committed else None}
