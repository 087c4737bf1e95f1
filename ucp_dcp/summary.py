"""Summaries of a DCP checkpoint: source topology and per-atom shape, dtype, kind, chunks, bytes.

Works on any DCP checkpoint; without a ucp_dcp catalog the topology is reported as unknown and
kinds are inferred from the metadata. Opening never runs code from the checkpoint (see
:func:`ucp_dcp.commit.open_checkpoint`).
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._compat import fsspec_filesystem
from .catalog import read_catalog
from .commit import Integrity, open_checkpoint

__all__ = ["summarize", "format_summary", "read_metadata", "open_path"]


def open_path(path: str | os.PathLike, *, trust: bool = False) -> tuple[Metadata, Integrity]:
    """Metadata and integrity status of a checkpoint folder (local path or fsspec URL)."""
    if "://" in str(path):
        fs = fsspec_filesystem()()
        return open_checkpoint(fs, fs.init_path(str(path)), trust=trust)
    from torch.distributed.checkpoint.filesystem import FileSystem

    fs = FileSystem()
    return open_checkpoint(fs, fs.init_path(path), trust=trust)


def read_metadata(path: str | os.PathLike, *, trust: bool = False) -> Metadata:
    """``Metadata`` of a checkpoint folder, opened safely."""
    return open_path(path, trust=trust)[0]


def summarize(md: Metadata, integrity: Integrity | None = None) -> dict[str, Any]:
    catalog = read_catalog(md.planner_data)
    cat_atoms = (catalog or {}).get("atoms", {})
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
        row["kind"] = rec.get("kind", "object" if row["shape"] is None else "tensor")
        row["pattern"] = rec.get("pattern", "unknown")
        if rec.get("live"):
            row["live"] = rec["live"]
        row["layouts"] = _layouts(rec, catalog)
        row["bytes"] = sizes.get(name, 0)
        atoms[name] = row
    return {
        "ucp_catalog": catalog is not None,
        "catalog_version": (catalog or {}).get("version"),
        "writer": (catalog or {}).get("writer"),
        "topology": (catalog or {}).get("topology"),
        "dcp_version": md.version,
        "atoms": atoms,
        "total_bytes": sum(sizes.values()),
        "integrity": None if integrity is None else {
            "status": integrity.status, "sidecar": integrity.sidecar, "algo": integrity.algo,
            "strays": integrity.strays, "summary": integrity.describe()},
    }


def _layouts(rec: dict[str, Any], catalog: dict[str, Any] | None) -> list[str]:
    out = []
    meshes = (catalog or {}).get("topology", {}).get("meshes", [])
    for lay in rec.get("layouts", []):
        mesh = meshes[lay["mesh"]] if lay["mesh"] < len(meshes) else {"shape": "?", "dim_names": None}
        names = mesh.get("dim_names") or [f"d{i}" for i in range(len(mesh["shape"]))]
        dims = ",".join(f"{n}={s}" for n, s in zip(names, mesh["shape"]))
        text = f"({dims})[{','.join(lay['placements'])}]"
        if text not in out:
            out.append(text)
    return out


def format_summary(s: dict[str, Any]) -> str:
    lines = []
    topo = s["topology"]
    if topo:
        meshes = "; ".join(
            "x".join(map(str, m["shape"])) + (f" ({','.join(m['dim_names'])})" if m.get("dim_names") else "")
            for m in topo["meshes"]
        ) or "none"
        lines.append(f"source topology: world_size={topo['world_size']}, meshes: {meshes}")
        lines.append(f"catalog v{s['catalog_version']} written by {s['writer']}")
    else:
        lines.append("source topology: unknown (no ucp_dcp catalog; written by another planner)")
    lines.append(f"{len(s['atoms'])} atoms, {s['total_bytes'] / 2**20:.2f} MiB in data files")
    if s.get("integrity"):
        lines.append(f"integrity: {s['integrity']['summary']}")
    w = max((len(n) for n in s["atoms"]), default=4)
    lines.append(f"{'atom':<{w}}  {'shape':<16} {'dtype':<9} {'kind':<11} {'pattern':<10} {'chunks':>6} {'bytes':>10}  layout")
    for name, r in s["atoms"].items():
        shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
        shape = shape or "scalar"
        live = f" <- {r['live']}" if r.get("live") else ""
        lines.append(
            f"{name:<{w}}  {shape:<16} {r['dtype'] or '-':<9} {r['kind']:<11} {r['pattern']:<10} {r['chunks']:>6} "
            f"{r['bytes']:>10}  " + " ".join(r["layouts"]) + live
        )
    return "\n".join(lines)
