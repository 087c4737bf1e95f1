"""The coordinator's side of a UCP save: checks across ranks, the global plan, the metadata."""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from . import catalog as cat_mod
from .compact import BYTES, TENSOR, LocalItems, plan_global, unpack_items
from .errors import PatternError
from .patterns import Patterns
from .checks import check_digests, check_rules_and_ownership, reduce_values

__all__ = ["coordinate_save", "reduce_all"]


def reduce_all(patterns: Patterns, pds: list[dict[str, Any]]) -> dict[str, Any]:
    """Values of ``Reduce`` atoms: copies within a data slot must agree and count once."""
    values: dict[str, dict[Any, list[Any]]] = {}
    for rank, pd in enumerate(pds):
        slot = pd.get("slot")
        for name, v in (pd.get("reduce") or {}).items():
            values.setdefault(name, {}).setdefault(("rank", rank) if slot is None else slot, []).append(v)
    out = {}
    for name, by_slot in values.items():
        rule = patterns.reduce(name)
        if rule is None:
            raise PatternError(f"atom '{name}' is reduced on some ranks but no rule matches it here", atom=name)
        per_slot = [reduce_values("equal", copies, name) for _, copies in sorted(by_slot.items(), key=str)]
        out[name] = reduce_values(rule.op, per_slot, name)
    return out


def check_all(patterns: Patterns, pds: list[dict[str, Any]], structures: dict[bytes, dict[str, Any]],
              maps: dict[str, int | None], mode: str) -> None:
    """Rule usage, index ownership and replica agreement over all ranks (grouping identical ranks)."""
    check_rules_and_ownership(patterns, pds, maps, "at save")
    groups: dict[tuple, dict[str, Any]] = {}
    for rank, pd in enumerate(pds):
        key = (pd["sh"], pd["dg"], tuple(pd.get("local_mismatch") or ()))
        g = groups.get(key)
        if g is None:
            names = structures[pd["sh"]]["digest_names"]
            digests = np.frombuffer(zlib.decompress(pd["dg"]), dtype=np.uint64).tolist()
            g = groups[key] = {"ranks": [], "digests": dict(zip(names, digests)),
                               "local_mismatch": list(pd.get("local_mismatch") or ())}
        g["ranks"].append(rank)
    warn = {k for pd in pds for k in pd.get("warn_keys") or ()}
    check_digests(list(groups.values()), mode, warn_keys=warn)


def coordinate_save(pds: list[dict[str, Any]], reduced: dict[str, Any], lowest_rank: bool,
                    writer: dict[str, str], rules_json: list[dict[str, Any]], map_keys: list[str]) -> tuple[list[SavePlan], Metadata]:
    """Global plans (a keep mask per rank, reduced items for the coordinator) and the metadata."""
    items: list[LocalItems] = [unpack_items(pd["it"]) for pd in pds]
    result = plan_global([pd["s"] for pd in pds], [pd["sh"] for pd in pds], items, lowest_rank)
    coordinator = next((i for i, pd in enumerate(pds) if pd.get("coordinator")), 0)
    sdm = result.state_dict_metadata
    extra = []
    for name, value in sorted(reduced.items()):
        if isinstance(value, torch.Tensor):
            zeros = (0,) * value.ndim
            sdm[name] = TensorStorageMetadata(TensorProperties(dtype=value.dtype), value.shape,
                                              [ChunkStorageMetadata(torch.Size(zeros), value.shape)])
            extra.append((name, TENSOR, zeros, tuple(value.shape), value.dtype))
        else:
            sdm[name] = BytesStorageMetadata()
            extra.append((name, BYTES, (), (), None))
    mappings: dict[str, Any] = {}
    local_cats = []
    for st in result.structures:
        mappings.update(st["paths"])
        local_cats.append(st["catalog"])
    catalog = cat_mod.merge_local_catalogs(local_cats, writer=writer, world_size=len(pds))
    catalog["rules"] = rules_json
    catalog["maps"] = sorted(map_keys)
    planner_data: dict[str, Any] = {k: mappings[k] for k in sdm if k in mappings}
    planner_data[cat_mod.CATALOG_KEY] = catalog
    averages = _average_writers(pds, items, result)
    plans = []
    for rank, keep in enumerate(result.keep):
        data: dict[str, Any] = {"keep": np.packbits(keep).tobytes(), "n": len(keep)}
        if rank == coordinator and extra:
            data["extra"] = extra
        if averages.get(rank):
            data["average"] = averages[rank]
        if any(averages.values()):
            data["exchange"] = True  # every rank, so a side group (NCCL-only jobs) is created by all
        plans.append(SavePlan([], planner_data=data))
    return plans, Metadata(state_dict_metadata=sdm, planner_data=planner_data)


def _average_writers(pds: list[dict[str, Any]], items: list[LocalItems], result: Any) -> dict[int, dict]:
    """``Replicated(check="average")`` pieces: who holds them, and who writes (and so averages) them."""
    holders: dict[str, list[int]] = defaultdict(list)
    for pd in pds:
        for key in pd.get("average") or ():
            holders[key].append(pd.get("global_rank", 0))
    if not holders:
        return {}
    rank_of = [pd.get("global_rank", 0) for pd in pds]
    writer: dict[str, int] = {}
    for r, (it, keep) in enumerate(zip(items, result.keep)):
        st = result.structures[result.structure_of[r]]
        for i in np.nonzero(keep)[0].tolist():
            name = st["names"][int(it.atom[i])]
            nd = len(st["shapes"][int(it.atom[i])] or ())
            key = f"{name}@{','.join(map(str, it.off[i, :nd].tolist()))}"
            if key in holders:
                writer[key] = rank_of[r]
    out: dict[int, dict] = {}
    for r, g in enumerate(rank_of):
        mine = {k: (writer[k], sorted(h)) for k, h in holders.items() if g in h and k in writer}
        if mine:
            out[r] = mine
    return out


def merge_cached(pds: list[dict[str, Any]], cached: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Plans of ranks whose local plan did not change come from the cache (only their small
    summaries travelled)."""
    out = []
    for i, pd in enumerate(pds):
        if "s" in pd:
            out.append(pd)
        elif cached is None:
            raise RuntimeError("UCP plan cache is empty but a rank sent a cached plan")
        else:
            out.append({**cached[i], **pd})
    return out

