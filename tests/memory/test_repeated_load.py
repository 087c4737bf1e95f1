"""A repeated memory-tier load at an unchanged layout plans once (issue 45): the second load of the same
generation into the same target in one process reuses the plans of the first (``cache_plans``, the
default planner's default), bitwise. Without ``cache_plans`` every load plans again. Two simulated hosts
(``UCP_DCP_HOST``) of the shared gloo pool, one rank each."""

import dist as D
import pytest
import torch

from ucp_dcp.memory import MemoryTier
from ucp_dcp.memory import load as memory_load
from ucp_dcp.planning import plan_cache

pytestmark = pytest.mark.slow


def _state(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(seed))
    rows = w.shape[0] // world
    return {"w": DTensor.from_local(w[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)}


def _three_loads(rank, world, root):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    with MemoryTier(root, replicas=1) as tier:
        tier.save(_state(rank, world, 1), step=1)
    plan_cache.clear()
    want = _state(rank, world, 1)["w"].to_local()
    out = []
    for cache in (True, True, False):
        got = {"w": torch.zeros_like(_state(rank, world, 1)["w"])}
        src = memory_load(got, root, cache_plans=cache)
        out.append((src.tier, src.stats.plan_cached, torch.equal(got["w"].to_local(), want)))
    return out


def test_a_second_memory_load_at_the_same_layout_reuses_its_plans_bitwise():
    for rank, out in enumerate(D.run(_three_loads, 2, D.tmpdir())):
        assert out == [("memory", False, True), ("memory", True, True), ("memory", False, True)], (rank, out)
