"""Planning at scale, simulated in one process: per-rank plans are built synthetically (what each
rank would send), then the coordinator's work is timed for DCP's default planners and ucp_dcp's.

Model: ``tensors`` FSDP-sharded tensors (``Shard(0)`` over all ranks) plus ``tensors`` replicated
scalars (like optimizer ``step``) per rank -- the setting of the DCP measurement quoted in the issue.
Rank-0 cost = unpickling the gathered plans + the global plan + pickling the per-rank answers
(CPU time); plan bytes = the pickled local plans gathered on rank 0.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import time
import zlib
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ucp_dcp import UCPFileSystemReader, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.layout.patterns import Patterns
from ucp_dcp.planning.payloads import (
    ItemKind,
    LoadPlanPayload,
    LocalItems,
    LocalPlanPayload,
    PackedPlan,
    PlanStructure,
    RuleUsage,
    dtype_code,
)
from ucp_dcp.storage.transport import local_summary

ROWS, COLS = 8, 256  # rows per rank and columns of every sharded tensor


def _names(tensors: int) -> list[str]:
    return [f"model.layers.{i // 8}.block.w{i % 8}.weight" for i in range(tensors)]


def dcp_local_plan(rank: int, ranks: int, tensors: int) -> SavePlan:
    props = TensorProperties(dtype=torch.float32)
    items = []
    mappings = {}
    for name in _names(tensors):
        off = torch.Size((rank * ROWS, 0))
        size = torch.Size((ROWS, COLS))
        items.append(
            WriteItem(
                index=MetadataIndex(name, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(off, size), props, torch.Size((ranks * ROWS, COLS))),
            )
        )
        mappings[name] = tuple(name.split(".", 1))
        step = name.replace("model.", "optim.state.") + ".step"
        zero = torch.Size(())
        items.append(
            WriteItem(
                index=MetadataIndex(step, zero),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(ChunkStorageMetadata(zero, zero), props, zero),
            )
        )
        mappings[step] = ("optim", "state", name.split(".", 1)[1], "step")
    return SavePlan(items, planner_data=mappings)


def ucp_local_plan(rank: int, ranks: int, tensors: int) -> SavePlan:
    """What ``UCPSavePlanner.create_local_plan`` sends for the same state (built without tensors)."""
    names, shapes, dtypes, paths = [], [], [], {}
    mesh = {"shape": [ranks], "dim_names": ["dp"], "ranks": list(range(ranks))}
    cat = {"meshes": [mesh], "atoms": {}}
    f32 = dtype_code(torch.float32)
    for name in _names(tensors):
        step = name.replace("model.", "optim.state.") + ".step"
        param = name.split(".", 1)[1]
        names += [name, step]
        shapes += [(ranks * ROWS, COLS), ()]
        dtypes += [f32, f32]
        paths[name] = tuple(name.split(".", 1))
        paths[step] = ("optim", "state", param, "step")
        cat["atoms"][name] = {
            "kind": "model",
            "param": param,
            "value": "tensor",
            "shape": [ranks * ROWS, COLS],
            "dtype": "float32",
            "pattern": "dtensor",
            "layout": {"mesh": 0, "placements": ["S(0)"]},
        }
        cat["atoms"][step] = {
            "kind": "optim_state",
            "param": param,
            "value": "tensor",
            "shape": [],
            "dtype": "float32",
            "pattern": "plain",
        }
    n = len(names)
    off = np.full((n, 2), -1, dtype=np.int64)
    size = np.full((n, 2), -1, dtype=np.int64)
    off[0::2] = (rank * ROWS, 0)
    size[0::2] = (ROWS, COLS)
    kind = np.tile(np.array([ItemKind.SHARD, ItemKind.TENSOR], dtype=np.uint8), tensors)
    items = LocalItems(np.arange(n, dtype=np.int32), kind, off, size)
    structure = PlanStructure(names, shapes, dtypes, paths, cat, whole_digests=sorted(names[1::2]), piece_digests=[])
    digests = np.full(len(structure.whole_digests), 0x1234567890ABCDEF, dtype=np.uint64)  # the same step everywhere
    payload = LocalPlanPayload(
        packed=PackedPlan.pack(structure, items),
        digests=zlib.compress(digests.tobytes(), 1),
        tie_mismatches=[],
        reduced={},
        data_slot=None,
        usage=RuleUsage(),
        warn_atoms=[],
        averaged=[],
        coordinator=rank == 0,
        global_rank=rank,
    )
    return SavePlan([], planner_data=payload)


def _dcp_read_items(rank: int, tensors: int) -> list[ReadItem]:
    items = []
    for name in _names(tensors):
        off = torch.Size((rank * ROWS, 0))
        items.append(
            ReadItem(
                LoadItemType.TENSOR,
                MetadataIndex(name, off, 0),
                torch.Size((0, 0)),
                MetadataIndex(name, off, rank),
                torch.Size((0, 0)),
                torch.Size((ROWS, COLS)),
            )
        )
        step = name.replace("model.", "optim.state.") + ".step"
        z = torch.Size(())
        items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(step, z, 0), z, MetadataIndex(step, z, 0), z, z))
    return items


class _FakeMeta:
    def __init__(self, tensors: int) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        props = TensorProperties(dtype=torch.float32)
        self.state_dict_metadata = {}
        for name in _names(tensors):
            self.state_dict_metadata[name] = TensorStorageMetadata(props, torch.Size((1, COLS)), [])
            self.state_dict_metadata[name.replace("model.", "optim.state.") + ".step"] = TensorStorageMetadata(
                props, torch.Size(()), []
            )
        self.storage_data = {}


def _timed_coordinator(plans: list[Any], work) -> tuple[float, int, Any]:
    """Pickle every rank's plan (the gather), then time rank 0: unpickle, plan, pickle answers."""
    blobs = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in plans]
    nbytes = sum(len(b) for b in blobs)
    del plans
    gc.collect()
    t0 = time.process_time()
    got = [pickle.loads(b) for b in blobs]
    del blobs
    out = work(got)
    answers = out[0] if isinstance(out, tuple) else out
    for a in answers:
        pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL)
    return time.process_time() - t0, nbytes, out


def simulate(ranks: int, tensors: int, system: str, phase: str, caching: bool = False) -> dict[str, float]:
    """Rank-0 seconds and gathered plan bytes for one simulated save or load planning step."""
    if phase == "save":
        if system == "dcp":
            planner = DefaultSavePlanner(enable_plan_caching=caching)
            plans = [dcp_local_plan(r, ranks, tensors) for r in range(ranks)]
        else:
            planner = UCPSavePlanner(enable_plan_caching=caching)
            planner.set_up_planner({}, None, True)
            plans = [ucp_local_plan(r, ranks, tensors) for r in range(ranks)]
        if caching:  # warm the cache, then every rank reports an unchanged plan
            SavePlanner._cached_all_plans.clear()
            planner.create_global_plan(plans)
            if system == "dcp":
                plans = [SavePlan([], usable=False) for _ in range(ranks)]
            else:
                plans = [
                    SavePlan([], usable=False, planner_data=dataclasses.replace(p.planner_data, packed=None))
                    for p in plans
                ]
        secs, nbytes, (_, metadata) = _timed_coordinator(plans, planner.create_global_plan)
        return {"seconds": secs, "plan_bytes": nbytes, "metadata_bytes": len(pickle.dumps(metadata))}
    if system == "dcp":
        plans = [LoadPlan(_dcp_read_items(r, tensors)) for r in range(ranks)]
        planner = DefaultLoadPlanner()
    else:
        md = _FakeMeta(tensors)
        plans = []
        for r in range(ranks):  # what UCPFileSystemReader.prepare_local_plan leaves in a gathered plan
            plans.append(
                LoadPlan(
                    [],
                    storage_data=local_summary(_dcp_read_items(r, tensors), md, "ranks", rank=r, host="h"),
                    planner_data=LoadPlanPayload(RuleUsage(), "ranks", keeps_items=True),
                )
            )
        planner = UCPLoadPlanner()
        planner._patterns = Patterns(())
        reader = UCPFileSystemReader(".")
        secs, nbytes, _ = _timed_coordinator(
            plans, lambda ps: reader.prepare_global_plan(planner.create_global_plan(ps))
        )
        return {"seconds": secs, "plan_bytes": nbytes}
    secs, nbytes, _ = _timed_coordinator(plans, planner.create_global_plan)
    return {"seconds": secs, "plan_bytes": nbytes}
