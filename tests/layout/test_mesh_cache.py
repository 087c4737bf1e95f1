"""What ucp_dcp works out per device mesh is cached beside the mesh, not on it: a mesh is pickled with every
``torch.save`` of a DTensor on it, and an attribute of ours there (``_ucp_dcp_mesh_info``) made such files
unloadable with ``weights_only=True`` (torch's default) and wherever ucp_dcp is not installed."""

import io

import dist as D
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ucp_dcp.layout.placements import mesh_info

pytestmark = pytest.mark.slow


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    t = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    info = mesh_info(t)
    assert mesh_info(t) is info  # computed once per mesh
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    raw = buf.getvalue()
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    return b"ucp_dcp" not in raw and torch.equal(back["w"].to_local(), t.to_local())


def test_a_dtensor_saved_after_ucp_dcp_saw_its_mesh_loads_with_weights_only():
    assert D.run(_worker, 2) == [True, True]
