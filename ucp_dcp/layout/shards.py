"""The local shards of values that carry no placements: a ``ShardedTensor`` (FSDP1 ``SHARDED_STATE_DICT``,
``torch.distributed._shard``: its shard plan lists boxes, read by :func:`sharded_tensor_shards` with nested
ShardedTensors flattened, and described for the catalog in builtins by :func:`sharded_tensor_record`) and
torch 2.14's ``CheckpointableTensor`` (:func:`checkpointable_shards`). DTensor placements:
:mod:`ucp_dcp.layout.placements`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._compat import ShardedTensor, is_checkpointable_tensor
from ..errors import AmbiguousLayoutError
from .placements import Layout

__all__ = [
    "LocalShard",
    "sharded_tensor_shards",
    "sharded_tensor_record",
    "SHARD_RECORD_LIMIT",
    "CheckpointableShard",
    "checkpointable_shards",
    "global_shape",
]

# -- ShardedTensor ----------------------------------------------------------------------------------

SHARD_RECORD_LIMIT = 64
"""Shard plans with at most this many shards are listed in the catalog record in full; larger ones
(FSDP1 at scale: one shard per rank) keep the spec, its dim and the count. Every rank sends its
records to the coordinator, so a full list would cost O(ranks^2) per atom on the gather."""


@dataclass(frozen=True)
class LocalShard:
    """One piece of a ShardedTensor held by this rank, in the global tensor's coordinates."""

    offsets: tuple[int, ...]
    """Where the piece starts in the global tensor (nested offsets added up)."""
    sizes: tuple[int, ...]
    """Its extent per dim (the tensor's shape)."""
    tensor: torch.Tensor
    """The local memory."""


def sharded_tensor_shards(st: Any, name: str) -> list[LocalShard]:
    """This rank's pieces of ShardedTensor ``st`` (atom ``name``, for errors).

    A local shard whose tensor is itself a ShardedTensor (FSDP1 over a ``torch.distributed._shard``
    tensor-parallel shard: ``torch.distributed.tensor.parallel.fsdp``) contributes its own local
    shards, their offsets added to the outer shard's, at any depth and any count (DCP's
    ``_flatten_sharded_tensors`` does the same for one inner shard). Each piece must have the shape
    its metadata states and lie inside its parent; every piece must share one dtype and device."""
    out: list[LocalShard] = []
    _collect_shards(st, (0,) * len(st.size()), tuple(int(s) for s in st.size()), name, out)
    if len({p.tensor.dtype for p in out}) > 1 or len({p.tensor.device for p in out}) > 1:
        raise AmbiguousLayoutError(
            f"'{name}': the local shards of this ShardedTensor differ in dtype or device "
            f"({sorted({f'{p.tensor.dtype}@{p.tensor.device}' for p in out})})",
            atom=name,
            hint="keep every local shard of one ShardedTensor in one dtype on one device",
        )
    return out


def _collect_shards(st: Any, origin: tuple[int, ...], bound: tuple[int, ...], name: str, out: list[LocalShard]) -> None:
    for shard in st.local_shards():
        md = shard.metadata
        offs = tuple(int(o) for o in md.shard_offsets)
        sizes = tuple(int(n) for n in md.shard_sizes)
        if len(offs) != len(bound) or any(o < 0 or o + n > b for o, n, b in zip(offs, sizes, bound)):
            raise AmbiguousLayoutError(
                f"'{name}': a local shard at offsets {list(offs)} with sizes {list(sizes)} does not fit inside "
                f"shape {list(bound)} (the ShardedTensor's, or the shard holding it)",
                atom=name,
                saved=list(bound),
                wanted=[list(offs), list(sizes)],
                hint="the ShardedTensor's metadata is inconsistent; rebuild it from its local shards",
            )
        at = tuple(a + o for a, o in zip(origin, offs))
        t = shard.tensor
        if isinstance(t, ShardedTensor):
            if tuple(int(s) for s in t.size()) != sizes:
                raise AmbiguousLayoutError(
                    f"'{name}': a nested ShardedTensor of shape {list(t.size())} sits in a shard of sizes "
                    f"{list(sizes)}",
                    atom=name,
                    saved=list(sizes),
                    wanted=list(t.size()),
                    hint="an inner ShardedTensor must have the shape of the outer shard it fills",
                )
            _collect_shards(t, at, sizes, name, out)
            continue
        if isinstance(t, DTensor):
            raise AmbiguousLayoutError(
                f"'{name}': a ShardedTensor shard holds a DTensor ({Layout.from_dtensor(t).describe()}); the "
                "shard metadata states one box but the DTensor holds only its own piece of it, and no torch "
                "API builds such a value (FSDP1 + tensor parallelism nests ShardedTensors, or uses DTensors "
                "throughout with a device mesh)",
                atom=name,
                hint="save the DTensor itself, or give FSDP1 a device_mesh so its state dict holds DTensors",
            )
        if tuple(t.shape) != sizes:
            raise AmbiguousLayoutError(
                f"'{name}': a local shard's tensor has shape {list(t.shape)} but its metadata states sizes "
                f"{list(sizes)}",
                atom=name,
                saved=list(sizes),
                wanted=list(t.shape),
                hint="the ShardedTensor's metadata is inconsistent with its local shards",
            )
        out.append(LocalShard(at, sizes, t))


def sharded_tensor_record(st: Any) -> dict[str, Any]:
    """The catalog's description of a ShardedTensor's shard plan, in builtins only::

        {"kind": "sharded_tensor", "spec": "chunk", "dim": 0, "count": 4,
         "shards": [{"offsets": [0, 0], "sizes": [3, 5], "placement": "rank:0/cpu"}, ...]}

    ``spec`` is ``chunk`` (``ChunkShardingSpec``, with its ``dim``), ``enumerable`` or the spec's
    class name; ``shards`` is the global plan from the metadata (every rank holds the same), listed
    up to :data:`SHARD_RECORD_LIMIT` shards; ``nested`` marks shards that are ShardedTensors."""
    spec = getattr(st, "_sharding_spec", None)
    kind = type(spec).__name__ if spec is not None else "none"
    rec: dict[str, Any] = {
        "kind": "sharded_tensor",
        "spec": {"ChunkShardingSpec": "chunk", "EnumerableShardingSpec": "enumerable"}.get(kind, kind),
    }
    if rec["spec"] == "chunk":
        rec["dim"] = int(spec.dim) if isinstance(spec.dim, int) else str(spec.dim)
    plan = st.metadata().shards_metadata
    rec["count"] = len(plan)
    if len(plan) <= SHARD_RECORD_LIMIT:
        rec["shards"] = [
            {
                "offsets": [int(o) for o in m.shard_offsets],
                "sizes": [int(n) for n in m.shard_sizes],
                "placement": str(m.placement),
            }
            for m in plan
        ]
    if any(isinstance(s.tensor, ShardedTensor) for s in st.local_shards()):
        rec["nested"] = True
    return rec


# -- CheckpointableTensor (torch >= 2.14) ---------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointableShard:
    """One shard of a ``CheckpointableTensor``: a box of the global tensor held at a box of the local one."""

    global_offsets: tuple[int, ...]
    """Where the shard starts in the global tensor."""
    local_offsets: tuple[int, ...]
    """Where it starts in the local tensor (one local tensor may hold several shards, and padding)."""
    sizes: tuple[int, ...]
    """Its extent per dim (the same in both)."""


def global_shape(value: torch.Tensor) -> tuple[int, ...]:
    """The logical shape of a tensor value: a ``CheckpointableTensor``'s ``global_shape``, else its
    shape (a DTensor's and a ShardedTensor's shape is already the global one)."""
    if is_checkpointable_tensor(value):
        return tuple(int(n) for n in value.global_shape)
    return tuple(int(n) for n in value.shape)


def checkpointable_shards(value: torch.Tensor, name: str) -> list[CheckpointableShard]:
    """The shards a ``CheckpointableTensor`` (DCP's protocol, pytorch#189492) states: one per entry of
    ``global_offsets``/``local_offsets``/``local_sizes``. Checked as DCP checks them (equal counts,
    ranks, every box inside the global and the local shape), but as an error naming the atom."""
    shape = global_shape(value)
    local = tuple(int(n) for n in value.shape)
    goffs, loffs, sizes = (list(getattr(value, f)) for f in ("global_offsets", "local_offsets", "local_sizes"))
    problem = None
    if not len(goffs) == len(loffs) == len(sizes):
        problem = (
            f"global_offsets, local_offsets and local_sizes have {len(goffs)}, {len(loffs)} and {len(sizes)} entries"
        )
    out = []
    for i, (g, lo, n) in enumerate(zip(goffs, loffs, sizes)):
        if problem:
            break
        g, lo, n = tuple(int(x) for x in g), tuple(int(x) for x in lo), tuple(int(x) for x in n)
        if not len(g) == len(n) == len(shape) or len(lo) != len(local) or len(n) != len(local):
            problem = (
                f"shard {i} has {len(g)}-d global offsets, {len(lo)}-d local offsets and {len(n)}-d sizes for "
                f"a {len(shape)}-d global and {len(local)}-d local tensor"
            )
        elif any(o < 0 or k < 0 or o + k > d for o, k, d in zip(g, n, shape)):
            problem = (
                f"shard {i} at global offsets {list(g)} with sizes {list(n)} lies outside global_shape {list(shape)}"
            )
        elif any(o < 0 or k < 0 or o + k > d for o, k, d in zip(lo, n, local)):
            problem = (
                f"shard {i} at local offsets {list(lo)} with sizes {list(n)} lies outside the local shape {list(local)}"
            )
        else:
            out.append(CheckpointableShard(g, lo, n))
    if problem:
        raise AmbiguousLayoutError(
            f"'{name}': a CheckpointableTensor states inconsistent shards: {problem}",
            atom=name,
            saved=list(shape),
            wanted=list(local),
            hint="set global_shape, global_offsets, local_offsets and local_sizes as torch's "
            "torch.distributed.checkpoint.CheckpointableTensor documents them",
        )
    return out
