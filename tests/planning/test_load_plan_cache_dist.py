"""The load-plan cache across ranks (``ucp_dcp.load``'s ``cache_plans``, :mod:`ucp_dcp.planning.plan_cache`), on
the 4-process pool: a repeated load is a hit on every rank, DCP's plan gather carries a few hundred bytes per
rank instead of the plan, the coordinator answers from its cache, and the state is bitwise what the first load
gave -- with read-once sending replicated bytes between (simulated) hosts under the cached answers. Another
checkpoint, layout or dtype plans afresh and loads right; a rank whose target changed re-plans alone and the
coordinator re-plans globally from the others' cached plans. One process: test_load_plan_cache.py."""

from __future__ import annotations

import pickle

import dist as D
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ucp_dcp
from ucp_dcp.planning import plan_cache

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

HANG_S = 120


LAYERS = 24
"""Small replicated tensors besides ``w``, ``v`` and ``b``: a plan of some size (the marker stays the same)."""


def _values(world: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(world * 4, 6, generator=g),
        "v": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g),
        **{f"layers.{i}.norm": torch.randn(4, generator=g) for i in range(LAYERS)},
    }


def _state(world: int, values: dict[str, torch.Tensor], w_dim: int = 0, dtype=torch.float32, step: int = 0):
    """``w`` sharded on dim ``w_dim``, ``v`` a replicated DTensor, ``b`` a plain tensor every rank holds, ``step``."""
    mesh = init_device_mesh("cpu", (world,))
    return {
        "w": distribute_tensor(values["w"].to(dtype), mesh, [Shard(w_dim)]),
        "v": distribute_tensor(values["v"].to(dtype), mesh, [Replicate()]),
        **{k: v.to(dtype).clone() for k, v in values.items() if k not in ("w", "v")},
        "step": step,
    }


def _zeros(world: int, w_dim: int = 0, dtype=torch.float32, skip=()):
    state = _state(world, {k: torch.zeros_like(v) for k, v in _values(world, 0).items()}, w_dim, dtype)
    return {k: v for k, v in state.items() if k not in skip}


def _equal(target, values, dtype=torch.float32, step: int = 0) -> bool:
    ok = target.get("step") == step if "step" in target else True
    for k in values:
        if k in target:
            got = target[k].full_tensor() if hasattr(target[k], "full_tensor") else target[k]
            ok &= got.dtype == dtype and torch.equal(got, values[k].to(dtype))
    return ok


def _spy() -> list[int]:
    """The pickled size of every object this rank hands ``dist.gather_object`` (DCP's plan gather)."""
    sizes: list[int] = []
    real = dist.gather_object

    def spy(obj, *args, **kwargs):
        sizes.append(len(pickle.dumps(obj)))
        return real(obj, *args, **kwargs)

    D.patch(dist, "gather_object", spy)
    return sizes


def _load(target, path, sizes, **kw):
    sizes.clear()
    stats = ucp_dcp.load(target, path, **kw)
    return stats.plan_cached, stats.global_plan_cached, sum(sizes), stats.bytes_received


def _repeat_worker(rank, world, root):
    D.setenv("UCP_DCP_HOST", f"host{rank}")  # one host per rank: read-once sends the replicated bytes
    values = _values(world, 1)
    ucp_dcp.save(_state(world, values, step=3), f"{root}/a")
    sizes = _spy()
    out = []
    same = _zeros(world)
    for target in (_zeros(world), _zeros(world), same, same):  # new targets, then one target twice
        out.append((*_load(target, f"{root}/a", sizes), _equal(target, values, step=3)))
    return out, dict(plan_cache.counters)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.full), 4])
def test_a_repeated_load_plans_once_and_gathers_a_few_bytes(world):
    res = D.run(_repeat_worker, world, D.tmpdir(), timeout=HANG_S)
    assert sum(loads[0][3] for loads, _ in res) > 0, res  # read-once sent bytes between the hosts
    for rank, (loads, counters) in enumerate(res):
        (c0, g0, sent0, recv0, ok0), *again = loads
        assert ok0 and not c0 and not g0, (rank, loads)
        for cached, global_cached, sent, recv, ok in again:
            assert ok and cached and global_cached, (rank, loads)
            assert sent < 320 and sent < sent0, (rank, loads)  # a marker (two 16-byte keys and DCP's LoadPlan)
            assert recv == recv0, (rank, loads)  # the cached read-once answer: the same exchange
        assert counters["local_hit"] == 3 and counters["reader_hit"] == 3, counters
        if rank == 0:
            assert counters["checks_reused"] == 3 and counters["transport_reused"] == 3, counters


def _invalidation_worker(rank, world, root):
    a, b = _values(world, 1), _values(world, 2)
    ucp_dcp.save(_state(world, a, step=1), f"{root}/a")
    ucp_dcp.save(_state(world, b, step=2), f"{root}/b")  # the same layout, other values
    sizes = _spy()
    out = {}
    for name, path, w_dim, dtype, values, step in (
        ("first", "a", 0, torch.float32, a, 1),
        ("again", "a", 0, torch.float32, a, 1),
        ("other checkpoint", "b", 0, torch.float32, b, 2),
        ("other sharding", "a", 1, torch.float32, a, 1),
        ("other dtype", "a", 0, torch.float64, a, 1),
        ("back", "a", 0, torch.float32, a, 1),
    ):
        target = _zeros(world, w_dim, dtype)
        cached, global_cached, _, _ = _load(target, f"{root}/{path}", sizes)
        out[name] = (cached, global_cached, _equal(target, values, dtype, step))
    return out


def test_another_checkpoint_sharding_or_dtype_plans_afresh_and_loads_right():
    for res in D.run(_invalidation_worker, 4, D.tmpdir(), timeout=HANG_S):
        assert all(ok for _, _, ok in res.values()), res
        hits = {name for name, (cached, global_cached, _) in res.items() if cached and global_cached}
        misses = {name for name, (cached, global_cached, _) in res.items() if not cached and not global_cached}
        assert hits == {"again", "back"} and misses == set(res) - hits, res


def _one_rank_worker(rank, world, root):
    D.setenv("UCP_DCP_HOST", f"host{rank}")
    values = _values(world, 1)
    ucp_dcp.save(_state(world, values, step=3), f"{root}/a")
    sizes = _spy()
    out = []
    for i in range(3):
        target = _zeros(world)
        if rank == 1 and i:  # from the second load on, rank 1 wants another key set: no `b`, an absent key
            del target["b"]
            target["not_saved"] = torch.full((2,), 5.0)
        cached, global_cached, _, recv = _load(target, f"{root}/a", sizes, allow_partial_load=True)
        kept = rank != 1 or not i or torch.equal(target["not_saved"], torch.full((2,), 5.0))
        out.append((cached, global_cached, recv, _equal(target, values, step=3) and kept))
    return out, plan_cache.counters.get("expanded", 0)


def test_a_rank_whose_target_changed_replans_and_the_coordinator_replans_with_the_cached_others():
    res = D.run(_one_rank_worker, 4, D.tmpdir(), timeout=HANG_S)
    for rank, (loads, expanded) in enumerate(res):
        assert all(ok for *_, ok in loads), (rank, loads)
        first, changed, again = loads
        assert first[:2] == (False, False), (rank, loads)
        # the changed load: rank 1 planned, the others sent markers; every answer was planned again
        assert changed[:2] == ((rank != 1), False), (rank, loads)
        assert again[:2] == (True, True), (rank, loads)  # the new key set is cached in turn
        if rank == 0:
            assert expanded == 3, expanded  # the three unchanged ranks' plans came from the coordinator's cache
    assert res[1][0][1][2] != res[1][0][0][2]  # rank 1 receives less once it no longer reads `b`
