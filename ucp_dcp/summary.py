"""Summaries of a DCP checkpoint: source topology and per-atom shape, dtype, kind, chunks, bytes and,
for small values, the value itself; and of a torchtitan ``checkpoint/`` folder of ``step-N`` checkpoints.

Works on any DCP checkpoint; without a ucp_dcp catalog the topology is reported as unknown. Kinds
(``model``, ``optim_state``, ``param_group``, ``optim``, ``train_state``, ``scheduler``,
``dataloader``, ``rng``, ``object``) come from the catalog for optimizer entries and from the
atom's name otherwise (torchtitan saves model weights at the top level, ``tok_embeddings.weight``).

Nothing here runs code from the checkpoint: metadata is opened by
:func:`ucp_dcp.commit.open_checkpoint`; a value is read only when small (objects up to
:data:`VALUE_BYTES`, tensors up to :data:`TENSOR_ELEMS` elements), checked against the checkpoint's
checksum when it has one (a mismatch is reported, the value is not shown), and decoded with
``torch.load(weights_only=True)``; a value holding any other type is refused, not decoded.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from ._compat import fsspec_filesystem
from .block_checks import BlockChecker
from .catalog import read_catalog
from .commit import METADATA, Integrity, open_checkpoint, scan
from .errors import CheckpointNotFoundError, IncompleteCheckpointError, UCPError
from .io_format import BLOCK, HASHES, IO_KEY, item_key

__all__ = ["summarize", "format_summary", "read_metadata", "open_path", "read_values", "atom_kinds",
           "fold_param_groups", "step_folders", "summarize_steps", "format_steps", "VALUE_BYTES", "TENSOR_ELEMS"]

VALUE_BYTES = 4096
"""Largest saved object (its item's bytes) whose value is read and shown."""
TENSOR_ELEMS = 8
"""Largest tensor (elements) whose value is read and shown (only when checksummed: it is verified)."""
TEXT_CHARS = 60
"""Longest value text in the human table (longer ones are cut with '...')."""


def _filesystem(path: str | os.PathLike) -> tuple[Any, Any]:
    """DCP file system object for a local path or an fsspec URL, and the initialized path."""
    if "://" in str(path):
        fs = fsspec_filesystem()()
        return fs, fs.init_path(str(path))
    from torch.distributed.checkpoint.filesystem import FileSystem

    fs = FileSystem()
    return fs, fs.init_path(path)


def open_path(path: str | os.PathLike, *, trust: bool = False) -> tuple[Metadata, Integrity]:
    """Metadata and integrity status of a checkpoint folder (local path or fsspec URL)."""
    fs, root = _filesystem(path)
    return open_checkpoint(fs, root, trust=trust)


def read_metadata(path: str | os.PathLike, *, trust: bool = False) -> Metadata:
    """``Metadata`` of a checkpoint folder, opened safely."""
    return open_path(path, trust=trust)[0]


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


# -- values -----------------------------------------------------------------------------------------


def _jsonable(v: Any, depth: int = 0) -> Any:
    """A JSON-able form of a decoded value (tuples become lists, other types their repr)."""
    if depth > 20:
        return "..."
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, torch.Tensor):
        return _jsonable(v.tolist(), depth + 1) if v.numel() <= TENSOR_ELEMS else _tensor_text(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x, depth + 1) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return f"<bytes, {len(v)}>"
    return repr(v)


def _num_text(v: Any) -> str:
    """Elements of a tensor value: floats to 6 significant digits."""
    if isinstance(v, list):
        return "[" + ", ".join(_num_text(x) for x in v) + "]"
    if isinstance(v, float) and math.isfinite(v):
        return repr(float(f"{v:.6g}"))
    return repr(v)


def _tensor_text(t: torch.Tensor) -> str:
    if t.numel() <= TENSOR_ELEMS:
        return f"tensor({_num_text(t.tolist())})"
    return f"<tensor {'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).removeprefix('torch.')}>"


def _text(v: Any, depth: int = 0) -> str:
    """Compact text of a decoded value (bytes and large tensors summarized)."""
    if depth > 6:
        return "..."
    if isinstance(v, torch.Tensor):
        return _tensor_text(v)
    if isinstance(v, (bytes, bytearray)):
        return f"<bytes, {len(v)}>"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_text(x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_text(x, depth + 1) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ", ".join(_text(x, depth + 1) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v)


def _cut(text: str, n: int = TEXT_CHARS) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _decode(data: bytes, name: str) -> dict[str, Any]:
    """A verified object item's value, decoded without running code."""
    if not data.startswith(b"PK\x03\x04"):  # written raw (an io.BytesIO value), not by torch.save
        return {"text": f"<bytes, {len(data)}>"}
    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:Unsupported global: GLOBAL|Unsupported operand|Trying to [^.]*)[^\n.]*", str(e))
        why = found.group(0).strip() if found else type(e).__name__
        return {"refused": f"value of '{name}' holds a type outside the safe set (tensors, numbers, strings, "
                           f"lists, dicts, tuples, ...): decoding it could run code ({why}); not decoded",
                "text": "<refused: type outside the safe set>"}
    except Exception as e:
        return {"error": f"value of '{name}' does not decode ({type(e).__name__}: {str(e)[:200]})",
                "text": "<error: does not decode>"}
    return {"value": _jsonable(value), "text": _text(value)}


def read_values(path: str | os.PathLike, md: Metadata, *, max_bytes: int = VALUE_BYTES,
                max_elems: int = TENSOR_ELEMS) -> dict[str, dict[str, Any]]:
    """Values of the checkpoint's small atoms, by atom: ``{"value": JSON-able, "text": short text,
    "verified": bool}``; ``{"text": "<object, N bytes>"}`` for an object over ``max_bytes``;
    ``{"error": why, "text": ...}`` when its bytes fail their checksum or cannot be read or decoded;
    ``{"refused": why, "text": ...}`` when it holds a type decoding could run code for.

    Objects (up to ``max_bytes``) are read whether or not the checkpoint has checksums (verified
    when it has); single-chunk tensors of at most ``max_elems`` elements only when their data is
    checksummed (others are left out)."""
    fs, root = _filesystem(path)
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    table = storage.get(MetadataIndex(IO_KEY)) or {}
    algo = table.get("algo") if table.get("algo") in HASHES else None
    sums = table.get("items", {}) if algo else {}
    must_have = bool(sums) and int(table.get("version", 1)) >= 2  # every object has a checksum then
    checker = BlockChecker(int(table.get("block", BLOCK)), algo or "")
    out: dict[str, dict[str, Any]] = {}
    jobs: dict[str, list[tuple]] = defaultdict(list)
    for name, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            index = MetadataIndex(name)
            info = storage.get(index)
            if info is None:
                out[name] = {"error": f"no storage entry for object '{name}'", "text": "<error: no storage entry>"}
                continue
            if getattr(info, "transform_descriptors", None):
                out[name] = {"text": f"<object, {info.length} bytes, transformed>"}
                continue
            if info.length > max_bytes:
                out[name] = {"text": f"<object, {info.length} bytes>"}
                continue
            entry = sums.get(item_key(index))
            if entry is None and must_have:
                out[name] = {"error": f"object '{name}' has no checksum in the checkpoint's I/O table",
                             "text": "<error: no checksum>"}
                continue
            jobs[info.relative_path].append((info.offset, info.length, name, index, entry[1] if entry else None, None))
        elif isinstance(smd, TensorStorageMetadata) and algo:
            numel = math.prod(int(s) for s in smd.size)
            if numel > max_elems or len(smd.chunks) != 1 or list(smd.chunks[0].sizes) != list(smd.size):
                continue
            index = MetadataIndex(name, smd.chunks[0].offsets)
            info, entry = storage.get(index), sums.get(item_key(index))
            nbytes = numel * smd.properties.dtype.itemsize
            if (info is None or entry is None or entry[0] < 0 or getattr(info, "transform_descriptors", None)
                    or entry[0] + nbytes > info.length):
                continue
            jobs[info.relative_path].append((info.offset + entry[0], nbytes, name, index, entry[1],
                                             (smd.properties.dtype, tuple(int(s) for s in smd.size))))
    for rel, todo in jobs.items():
        try:
            with fs.create_stream(fs.concat_path(root, rel), "rb") as f:
                for offset, length, name, index, crcs, tensor in sorted(todo, key=lambda j: j[0]):
                    out[name] = _read_one(f, rel, offset, length, name, index, crcs, tensor, checker)
        except (OSError, UCPError) as e:
            for job in todo:
                out.setdefault(job[2], {"error": f"cannot read {rel}: {e}", "text": "<error: cannot read>"})
    return out


def _read_one(f: Any, rel: str, offset: int, length: int, name: str, index: MetadataIndex, crcs: list[int] | None,
              tensor: tuple[torch.dtype, tuple[int, ...]] | None, checker: BlockChecker) -> dict[str, Any]:
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        return {"error": f"{rel} ends before the bytes of '{name}': the file is truncated",
                "text": "<error: truncated>"}
    if crcs is not None:
        try:
            checker.verify(memoryview(data), 0, crcs, rel, index)
        except UCPError as e:
            return {"error": e.message, "text": "<error: checksum mismatch>"}
    if tensor is None:
        got = _decode(data, name)
    else:
        dtype, shape = tensor
        try:
            t = (torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data
                 else torch.empty(shape, dtype=dtype))
            got = {"value": _jsonable(t.tolist()), "text": _num_text(t.tolist())}
        except Exception as e:  # a dtype without a Python form (float8, ...): say so, do not fail the summary
            return {"text": f"<tensor, {dtype}: {type(e).__name__}>"}
    if "value" in got:
        got["verified"] = crcs is not None
    return got


# -- summary ----------------------------------------------------------------------------------------


def summarize(md: Metadata, integrity: Integrity | None = None, *, path: str | os.PathLike | None = None,
              values: bool = True) -> dict[str, Any]:
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
    sizes: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
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
        row["pattern"] = rec.get("pattern", "unknown")
        if rec.get("live"):
            row["live"] = rec["live"]
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
        "integrity": None if integrity is None else {
            "status": integrity.status, "sidecar": integrity.sidecar, "algo": integrity.algo,
            "strays": integrity.strays, "summary": integrity.describe()},
    }


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
    parts = [f"{_mesh_text(m).replace('mesh ', f'mesh{i} ', 1)}" + (f" on ranks {_ranks_text(m['ranks'])}"
             if m.get("ranks") else "") for i, m in enumerate(meshes)]
    return f"{text}, {len(meshes)} meshes: " + "; ".join(parts)


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

_HP_ORDER = ("lr", "betas", "momentum", "weight_decay", "eps")


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
        members.setdefault((".".join(segs[:i + 1]), ".".join(segs[i + 1:-1])), {})[segs[-1]] = name
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    per_param = {prefix for (prefix, _), hps in members.items() if "params" not in hps}
    copies: list[tuple[str, dict[str, str]]] = []
    for (prefix, member), hps in members.items():
        if any("value" not in atoms[n] for hp, n in hps.items() if hp != "params"):
            continue
        if "params" in hps and prefix in per_param:  # ucp_dcp's copy in DCP's own form, for stock readers
            copies.append((prefix, hps))
            continue
        sig = json.dumps(["params" in hps] + sorted((hp, atoms[n]["value_text"]) for hp, n in hps.items()
                                                   if hp != "params"))
        g = groups.get((prefix, sig))
        if g is None:
            g = groups[(prefix, sig)] = {
                "prefix": prefix, "form": "group" if "params" in hps else "param", "members": [], "params": [],
                "values": {hp: atoms[n]["value"] for hp, n in sorted(hps.items(), key=_hp_key) if hp != "params"},
                "texts": {hp: atoms[n]["value_text"] for hp, n in sorted(hps.items(), key=_hp_key) if hp != "params"},
                "atoms": [], "bytes": 0}
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
        lines.append(f"values: objects up to {VALUE_BYTES} bytes" + (
            f" and tensors up to {TENSOR_ELEMS} elements, verified against their checksums" if checked else
            ", unverified (no checksums; tensor values not shown)") + "; decoded without running code")
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
    lines.append(f"{'atom':<{w}}  {'shape':<16} {'dtype':<9} {'kind':<11} {'pattern':<10} {'chunks':>6} {'bytes':>10}  "
                 f"{'layout':<{lw}}  value")
    for name, r, g in rows:
        if g is not None:
            pattern = {s["atoms"][n]["pattern"] for n in g["atoms"]}
            lines.append(f"{name:<{w}}  {'-':<16} {'-':<9} {'param_group':<11} "
                         f"{pattern.pop() if len(pattern) == 1 else 'mixed':<10} {len(g['atoms']):>6} "
                         f"{g['bytes']:>10}  {'':<{lw}}  {_group_text(g, same[g['prefix']])}".rstrip())
            continue
        shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
        shape = shape or "scalar"
        layout = " ".join(r["layouts"])
        value = _cut(r["value_text"]) if r.get("value_text") else ""
        live = f"  <- {r['live']}" if r.get("live") else ""  # the live tensor this atom is a part of
        lines.append(
            f"{name:<{w}}  {shape:<16} {r['dtype'] or '-':<9} {r['kind']:<11} {r['pattern']:<10} {r['chunks']:>6} "
            f"{r['bytes']:>10}  {layout:<{lw}}  {value}".rstrip() + live
        )
    if folds:
        n = sum(len(g["atoms"]) for g in folds)
        lines.append(f"({n} param_group rows folded into {len(folds)} line(s); --all shows every row)")
    errors = [(n, r["value_error"]) for n, r in s["atoms"].items() if r.get("value_error")]
    refused = [(n, r["value_refused"]) for n, r in s["atoms"].items() if r.get("value_refused")]
    if errors:
        lines.append(f"value errors ({len(errors)}): the checkpoint is damaged; `python -m ucp_dcp verify` checks "
                     "every byte")
        lines.extend(f"  {n}: {msg}" for n, msg in errors)
    if refused:
        lines.append(f"values not decoded ({len(refused)}):")
        lines.extend(f"  {n}: {msg}" for n, msg in refused)
    return "\n".join(lines)


# -- torchtitan checkpoint folders ------------------------------------------------------------------

_STEP = re.compile(r"step-(\d+)")


def step_folders(path: str | os.PathLike) -> list[tuple[int, str]] | None:
    """``(step, folder name)`` of the ``step-N`` subfolders of a torchtitan ``checkpoint/`` folder,
    by step; None when ``path`` is itself a checkpoint (holds ``.metadata``), is missing, or has no
    ``step-N`` subfolder."""
    fs, root = _filesystem(path)
    try:
        names = [os.path.basename(str(p).rstrip("/")) for p in fs.ls(root)]
    except OSError:  # missing, not a folder, unreadable: opening it as a checkpoint says which
        return None
    if METADATA in names:
        return None
    steps = sorted((int(m.group(1)), n) for n in names if (m := _STEP.fullmatch(n)))
    return steps or None


def summarize_steps(path: str | os.PathLike, *, trust: bool = False) -> dict[str, Any]:
    """One entry per ``step-N`` checkpoint of a torchtitan folder, by step: ``step``, ``path``,
    ``status`` (the integrity status, ``incomplete``, or ``damaged`` with ``error``), ``atoms``,
    ``total_bytes``, ``writer``, ``topology``, ``latest``. The latest is the step torchtitan
    resumes from: the highest one holding a ``.metadata``. Only metadata is read."""
    fs, root = _filesystem(path)
    steps = []
    for step, name in step_folders(path) or []:
        sub = fs.concat_path(root, name)
        st = scan(fs, sub)
        row: dict[str, Any] = {"step": step, "path": str(sub), "committed": bool(st and st.has_metadata),
                               "latest": False}
        try:
            md, integrity = open_checkpoint(fs, sub, trust=trust)
            s = summarize(md, integrity)
        except (IncompleteCheckpointError, CheckpointNotFoundError) as e:
            row.update(status="incomplete", error=e.message)
        except UCPError as e:
            row.update(status="damaged", error=e.message)
        else:
            row.update(status=integrity.status, atoms=len(s["atoms"]), total_bytes=s["total_bytes"],
                       ucp_catalog=s["ucp_catalog"], writer=s["writer"], topology=s["topology"],
                       topology_text=s["topology_text"], strays=len(integrity.strays))
        steps.append(row)
    committed = [r for r in steps if r["committed"]]
    if committed:
        committed[-1]["latest"] = True
    return {"folder": str(path), "steps": steps, "latest": committed[-1]["step"] if committed else None}


def _writer_text(row: dict[str, Any]) -> str:
    w = row.get("writer")
    if w:
        return f"ucp_dcp {w.get('ucp_dcp', '?')}"
    return "another planner" if "atoms" in row else "-"


def format_steps(d: dict[str, Any]) -> str:
    """The step listing as text: one line per step, the latest marked."""
    steps = d["steps"]
    latest = d["latest"]
    lines = [f"torchtitan checkpoint folder {d['folder']}: {len(steps)} step(s), "
             + (f"latest step {latest} (torchtitan resumes from it)" if latest is not None else "none committed")]
    sw = max([4] + [len(str(r["step"])) for r in steps])
    lines.append(f"{'step':>{sw}}  {'integrity':<10} {'atoms':>6} {'MiB':>9}  {'writer':<16} topology")
    for r in steps:
        if "atoms" in r:
            rest = (f"{r['atoms']:>6} {r['total_bytes'] / 2**20:>9.2f}  {_writer_text(r):<16} {r['topology_text']}"
                    + (f" ({r['strays']} stray file(s))" if r.get("strays") else ""))
        else:
            why = ("no .metadata: a save that did not commit (torchtitan skips it)" if r["status"] == "incomplete"
                   else _cut(r["error"], 100))
            rest = f"{'-':>6} {'-':>9}  {'-':<16} {why}"
        lines.append(f"{r['step']:>{sw}}  {r['status']:<10} {rest}" + ("  <- latest" if r["latest"] else ""))
    if steps:
        show = latest if latest is not None else steps[-1]["step"]
        lines.append(f"one step in full: python -m ucp_dcp inspect {d['folder']} --step {show}")
    return "\n".join(lines)
