"""Every private torch API ucp_dcp uses, in one place, and the torch releases they were checked on.

ucp_dcp relies on private DTensor/DCP internals (``_StridedShard`` semantics, DCP's storage-info
records and file views, its state-dict traversal helpers). A different torch may change them
silently, which in a checkpoint layer means silently wrong loads, so an untested torch fails at
import time (:func:`check_torch`), and no other module imports a private torch name directly:
they import it from here. Each was checked against torch 2.13.0.
"""

from __future__ import annotations

import os
import warnings

import torch

from torch.distributed import distributed_c10d as _c10d
from torch.distributed._shard._utils import narrow_tensor_by_index  # narrow a tensor to a box
from torch.distributed._shard.sharded_tensor import ShardedTensor  # legacy sharded values (refused)
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's nested-key flattening
from torch.distributed.checkpoint._traverse import set_element  # write a value at a state-dict path
from torch.distributed.checkpoint.filesystem import (  # DCP's file layout: our files stay readable by it
    _create_file_view,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner_helpers import _init_state_dict  # materialize lazy targets
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # a rank's piece of a DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 x TP non-contiguous shards

from .errors import UnsupportedTorchError

__all__ = ["check_torch", "default_group", "fsspec_filesystem", "narrow_tensor_by_index", "ShardedTensor",
           "flatten_state_dict", "set_element", "_create_file_view", "_split_by_size_and_type", "_StorageInfo",
           "_StoragePrefix", "_init_state_dict", "_StridedShard", "compute_local_shape_and_global_offset", "fake_store",
           "mesh_for_rank", "dtensor_from_local", "root_mesh"]


def default_group() -> "_c10d.ProcessGroup":
    """The default process group object (a cache key for groups we create per job)."""
    return _c10d._get_default_group()


def fsspec_filesystem() -> type:
    """DCP's fsspec-backed ``FileSystem`` (imported on use: it needs fsspec)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return FileSystem

def fake_store() -> "torch.distributed.Store":
    """A store for torch's fake process group (``init_process_group("fake", ...)``): one process
    plays any rank of any world size, collectives do nothing (``ucp_dcp.plan``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    return FakeStore()


def mesh_for_rank(mesh: "torch.distributed.device_mesh.DeviceMesh", rank: int, cache: dict) -> "torch.distributed.device_mesh.DeviceMesh":
    """``mesh`` as global rank ``rank`` sees it (``ucp_dcp.plan``): a copy with the same layout over
    the same root rank map whose stored rank and coordinate are ``rank``'s (DeviceMesh's private
    ``_rank``/``_coordinate_on_dim``/``_root_mesh``; ``DeviceMesh.mesh`` slices at the default
    group's rank, which must be ``rank``). No process groups are created. ``cache``: id -> copy."""
    hit = cache.get(id(mesh))
    if hit is not None:
        return hit
    new = object.__new__(type(mesh))  # not copy.copy: DeviceMesh.__setstate__ looks groups up again
    new.__dict__.update(mesh.__dict__)
    new.__dict__.pop("_ucp_dcp_mesh_info", None)  # ucp_dcp.layout's per-mesh cache: the copy has other ranks
    new._rank = rank
    new._hash = None
    if mesh._root_mesh is not None:
        new._root_mesh = mesh_for_rank(mesh._root_mesh, rank, cache)
    new._coordinate_on_dim = new._compute_coordinate_on_dim()
    cache[id(mesh)] = new
    return new


def dtensor_from_local(local: torch.Tensor, mesh: "torch.distributed.device_mesh.DeviceMesh", placements: tuple,
                       shape: "torch.Size", stride: tuple[int, ...]) -> "torch.distributed.tensor.DTensor":
    """A DTensor of ``local`` without ``from_local``'s checks and autograd (what FSDP2 does)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def root_mesh(mesh: "torch.distributed.device_mesh.DeviceMesh") -> "torch.distributed.device_mesh.DeviceMesh":
    """The mesh ``mesh`` was sliced from (itself if it was not sliced)."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


TESTED_TORCH = ((2, 13),)
"""``(major, minor)`` releases the test-suite runs on."""
ALLOW_ENV = "UCP_DCP_ALLOW_UNTESTED_TORCH"


def check_torch() -> None:
    base = torch.__version__.split("+")[0]
    try:
        major, minor = (int(x) for x in base.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    if (major, minor) in TESTED_TORCH:
        return
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_TORCH)
    msg = (
        f"ucp_dcp is tested with torch {tested}, found torch {torch.__version__}. It depends on private "
        f"DTensor/DCP internals that change between releases; install a tested torch "
        f"(e.g. `pip install torch==2.13.0`) or set {ALLOW_ENV}=1 to try anyway at your own risk."
    )
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(msg, stacklevel=3)
        return
    raise UnsupportedTorchError(msg, hint=f"pip install torch==2.13.0 (or set {ALLOW_ENV}=1)")
