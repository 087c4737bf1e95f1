"""A rank's local save plan: its write items as arrays, its structure, and small summaries."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import catalog as cat_mod
from .compact import BYTES, SHARD, TENSOR, LocalItems, dtype_code
from .digests import value_digest
from .fragments import Fragment
from .resolve import Resolved

__all__ = ["LocalPlan", "build_local", "frag_key", "avg_key", "is_averaged"]


@dataclass
class LocalPlan:
    """What ``create_local_plan`` computed on this rank."""

    structure: dict[str, Any]
    """Names, shapes, dtypes, flatten paths and catalog records (same on same-shaped ranks)."""
    items: LocalItems
    """Write items as arrays."""
    pieces: dict[tuple[str, tuple[int, ...] | None], tuple[Resolved, Fragment | None]]
    """``(atom, offsets)`` -> where the data is, for ``resolve_data``."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Small per-rank data for the coordinator's checks (digests, reductions, rule usage...)."""


def frag_key(f: Fragment) -> str:
    return f"{f.atom}@{list(f.box.offsets)}/{list(f.box.sizes)}"


def avg_key(f: Fragment) -> str:
    return f"{f.atom}@{','.join(map(str, f.box.offsets))}"


def is_averaged(r: Resolved) -> bool:
    return r.replicated is not None and r.replicated.check == "average" and isinstance(r.value, torch.Tensor)


def build_local(resolved: list[Resolved], mappings: dict[str, Any], check_replicas: str) -> LocalPlan:
    names: list[str] = []
    index: dict[str, int] = {}
    shapes: list[tuple[int, ...] | None] = []
    dtypes: list[int] = []
    local_cat = cat_mod.local_catalog()
    atoms, kinds, offs, sizes = [], [], [], []
    pieces: dict[tuple[str, tuple[int, ...] | None], tuple[Resolved, Fragment | None]] = {}
    digests: dict[str, int] = {}
    reduce_vals: dict[str, Any] = {}

    def atom_id(name: str, shape, dtype) -> int:
        if name not in index:
            index[name] = len(names)
            names.append(name)
            shapes.append(shape)
            dtypes.append(dtype_code(dtype) if dtype is not None else -1)
        return index[name]

    multi = dist.is_initialized() and dist.get_world_size() > 1

    def digest(name: str, value: Any, tied: bool = False) -> None:
        # copies on other ranks exist only in a multi-rank save; tied copies may share one rank
        if check_replicas != "off" and (multi or tied):
            d = value_digest(value)
            if d is not None:
                digests[name] = d

    for r in resolved:
        for name, rec in r.atoms.items():
            rec = dict(rec)
            if "layout" in rec:
                rec["layout"] = {"mesh": cat_mod.intern(local_cat["meshes"], rec["layout"]["mesh"]),
                                 "placements": rec["layout"]["placements"]}
            local_cat["atoms"][name] = rec
        is_tensor = isinstance(r.value, torch.Tensor)
        if r.reduce is not None:
            for name in r.atoms:
                atom_id(name, tuple(r.atoms[name]["shape"]) if is_tensor else None, r.value.dtype if is_tensor else None)
                reduce_vals[name] = r.value.detach().cpu().clone() if is_tensor else r.value
            continue
        if not is_tensor:
            for name in r.atoms:
                atoms.append(atom_id(name, None, None))
                kinds.append(BYTES)
                offs.append(())
                sizes.append(())
                pieces[(name, None)] = (r, None)
                digest(name, r.value)
            continue
        dtype = r.local.dtype
        dt = isinstance(r.value, DTensor)
        frag_list: list[tuple[str, Fragment | None]] = [(f.atom, f) for f in r.fragments]
        if r.value.numel() == 0:  # keep empty atoms visible in the metadata: one empty chunk each
            frag_list = [(name, None) for name in r.atoms]
        for name, f in frag_list:
            shape = tuple(r.atoms[name]["shape"])
            a = atom_id(name, shape, dtype)
            o = f.box.offsets if f is not None else (0,) * len(shape)
            s = f.box.sizes if f is not None else shape
            atoms.append(a)
            # DCP allows one TENSOR item per key: pieces (DTensor shards, fused blocks) are SHARDs
            kinds.append(TENSOR if not dt and tuple(s) == shape else SHARD)
            offs.append(tuple(o))
            sizes.append(tuple(s))
            pieces[(name, tuple(o))] = (r, f)
        if not dt:
            if r.replicated is None or r.replicated.check in ("error", "warn"):
                for name in r.atoms:
                    digest(name, r.value, bool(r.tied))
        elif r.tied or (r.replicated is not None and r.replicated.check in ("error", "warn")):
            for f in r.fragments:
                digests[frag_key(f)] = value_digest(f.view(r.local))
    width = max([len(o) for o in offs] + [1])
    off_arr = np.full((len(offs), width), -1, dtype=np.int64)
    size_arr = np.full((len(offs), width), -1, dtype=np.int64)
    for i, (o, s) in enumerate(zip(offs, sizes)):
        off_arr[i, :len(o)] = o
        size_arr[i, :len(s)] = s
    items = LocalItems(np.array(atoms, dtype=np.int32), np.array(kinds, dtype=np.uint8), off_arr, size_arr)
    structure = {
        "names": names, "shapes": shapes, "dtypes": dtypes,
        "paths": mappings,
        "catalog": local_cat, "digest_names": sorted(digests),
    }
    dg = np.array([digests[n] for n in structure["digest_names"]], dtype=np.uint64)
    summary = {"dg": zlib.compress(dg.tobytes(), 1), "reduce": reduce_vals}
    return LocalPlan(structure, items, pieces, summary)
