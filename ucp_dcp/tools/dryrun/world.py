"""One process plays every rank of a target job: torch's fake process group, meta tensors, and
state dicts rebuilt for another rank of the same structure.

A rank's state dict is built for real (the target's own code: modules on the meta device, FSDP2,
TP, pipeline splits) under a fake default process group of the target's world size whose rank is
the rank being planned. Ranks whose state dict has the same *structure* (keys, placements, global
shapes, meshes as layouts over the root mesh) -- e.g. all ranks of one pipeline stage -- can
instead take a representative's state dict with every DTensor rebound to the other rank: its
meshes rebuilt for that rank (same layout, same rank map) and its local tensor given the shape
DTensor itself computes for that rank. The planner then runs on that rank's state dict as it
would on a real one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..._compat import (
    ShardedTensor,
    dtensor_local_shape,
    dtensor_on_mesh,
    fake_store,
    local_tensor,
    mesh_for_rank,
)
from ...errors import UCPError
from ...layout.placements import declare_twin

__all__ = ["fake_rank", "rebind", "structure"]


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group (no communication) in which this process is ``rank``."""
    if dist.is_initialized():
        raise UCPError(
            "ucp_dcp.tools.dryrun plays every rank in this process with a fake process group; this process "
            f"already has a default process group ({dist.get_backend()})",
            hint="run the plan in a process of its own (python -m ucp_dcp plan ...)",
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rebind_tensor(t: DTensor, rank: int, cache: dict[Any, Any], keep_local: bool) -> DTensor:
    mesh = mesh_for_rank(t.device_mesh, rank, cache, declare_twin)
    if keep_local:
        local = local_tensor(t)
    else:
        key = (id(mesh), tuple(t.shape), tuple(t.placements))
        shape = cache.get(key)
        if shape is None:  # a parameter and its moments share it
            shape = cache[key] = dtensor_local_shape(t.shape, mesh, t.placements)
        local = torch.empty(shape, dtype=t.dtype, device="meta")
    return dtensor_on_mesh(t, local, mesh)


def rebind(state_dict: Any, rank: int, keep_local: bool = False) -> Any:
    """A copy of ``state_dict`` (nested dicts and lists) in which every DTensor is rank ``rank``'s
    piece of the same global tensor, on meshes rebuilt for ``rank``; other values are shared.

    ``keep_local``: keep each DTensor's local tensor (a state dict the target built for ``rank``
    itself: DTensor's op caches, keyed by meshes that compare equal across ranks, can hand back a
    mesh object of a rank built earlier in this process, whose stored coordinate is that rank's).
    Otherwise the local tensor gets the shape DTensor computes for ``rank``. The default process
    group must be rank ``rank``'s (:func:`fake_rank`)."""
    cache: dict[Any, Any] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, DTensor):
            return _rebind_tensor(v, rank, cache, keep_local)
        if isinstance(v, ShardedTensor) and not keep_local:
            raise UCPError(
                "a ShardedTensor (FSDP1 sharded state) cannot be rebound to another rank: its shards "
                "are per-rank metadata",
                hint="give the target no symmetry classes (every rank built)",
            )
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(state_dict)


def structure(state_dict: Any) -> dict[str, Any]:
    """What must agree between a state dict built for a rank and one rebound to it: per path the
    value's type and, for tensors, dtype, global and local shape, placements and mesh (ranks and
    dim names) -- and, for DTensors, this rank's coordinate."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        elif isinstance(v, DTensor):
            m = v.device_mesh
            out[prefix] = (
                "dtensor",
                v.dtype,
                tuple(v.shape),
                tuple(v.to_local().shape),
                tuple(v.placements),
                m.mesh.tolist(),
                m.mesh_dim_names,
                m.get_coordinate(),
            )
        elif isinstance(v, torch.Tensor):
            out[prefix] = ("tensor", v.dtype, tuple(v.shape))
        else:
            out[prefix] = (type(v).__name__,)

    walk("", state_dict)
    return out
