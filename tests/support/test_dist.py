"""The session's pool of gloo workers (tests/support/dist.py): results, failure reports, recovery from a
failing, dying or hanging rank, and what one task leaves for the next on the same workers."""

import os
import time

import dist as D
import pytest
import torch
import torch.distributed as dist

import ucp_dcp
from ucp_dcp import UCPSavePlanner

pytestmark = pytest.mark.slow

LEAK_ENV = "UCP_TEST_POOL_LEAK"
_counter = []  # a test module's own state: a task's appends are gone in the next task


def _identity(rank, world, tag):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, world, tag, float(t), os.getpid()


def test_results_come_back_rank_ordered_from_persistent_workers():
    a = D.run(_identity, 4, "a")
    b = D.run(_identity, 4, "b")
    assert [r[:4] for r in a] == [(r, 4, "a", 10.0) for r in range(4)]
    assert [r[4] for r in a] == [r[4] for r in b], "the same workers run the next task"
    assert len({r[4] for r in a}) == 4


def _fail_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # the others wait in a collective rank 1 never joins


def _die_on_rank_1(rank, world):
    print(f"rank {rank} about to go", flush=True)
    if rank == 1:
        os._exit(7)
    dist.barrier()


def _hang_on_rank_0(rank, world):
    if rank == 0:
        time.sleep(3600)
    return rank


@pytest.mark.parametrize(
    "fn, expected",
    [
        # each restart respawns the pool (seconds): the harness's own checks, not a layer's, in make test-full
        pytest.param(
            _fail_on_rank_1,
            ["--- rank 1: Traceback", "ValueError: rank one says no", "still running"],
            marks=pytest.mark.full,
        ),
        pytest.param(
            _die_on_rank_1, ["rank 1: the process died (exit code 7)", "rank 1 about to go"], marks=pytest.mark.full
        ),
        pytest.param(
            _hang_on_rank_0,
            ["rank 0: no result after 3s: hung", 'test_dist.py", line', "in _hang_on_rank_0"],
            marks=pytest.mark.full,
        ),
    ],
    ids=["raises", "dies", "hangs"],
)
def test_a_failing_rank_is_reported_and_the_pool_starts_afresh(fn, expected):
    # on the 2-process pool: a restart costs half the workers of the 4-process one most tests share
    before = [r[4] for r in D.run(_identity, 2, "before")]
    with pytest.raises(AssertionError) as info:
        D.run(fn, 2, timeout=3)
    text = str(info.value)
    for piece in expected:
        assert piece in text, text
    after = D.run(_identity, 2, "after")
    assert [r[:4] for r in after] == [(r, 2, "after", 3.0) for r in range(2)]
    assert not set(before) & {r[4] for r in after}, "a new pool: fresh workers"


def _plan_caches() -> dict[str, int]:
    """Sizes of the plan caches: DCP's (class attributes of SavePlanner, keyed by planner class) and
    any module dict of ucp_dcp or ucp_dev named like a cache (wherever a refactor puts it)."""
    import sys

    from torch.distributed.checkpoint.planner import SavePlanner

    out = {f"SavePlanner.{k}": len(v) for k, v in vars(SavePlanner).items() if k.startswith("_cached")}
    for name, mod in list(sys.modules.items()):
        if name.startswith(("ucp_dcp", "ucp_dev")) and mod is not None:
            out.update(
                {f"{name}.{k}": len(v) for k, v in vars(mod).items() if isinstance(v, dict) and "cache" in k.lower()}
            )
    return out


def _leave_state_behind(rank, world, root):
    os.environ[LEAK_ENV] = "1"
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    D.patch(ucp_dcp, "__version__", "patched")
    ucp_dcp.CATALOG_KEY = "assigned"  # a plain assignment: restored too
    ucp_dcp.leaked_name = 1  # a new global: removed
    _counter.append(rank)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234)
    os.chdir("/")
    h = dist.new_group([0, 1, 2], use_local_synchronization=True) if rank < 3 else None  # a hashed name
    g = dist.new_group([0, 1])
    import torch.distributed.checkpoint as dcp

    for i in range(2):  # the second save uses the cached plan
        dcp.save(
            {"w": torch.full((4,), float(i), dtype=torch.float32)},
            checkpoint_id=f"{root}/c{i}",
            planner=UCPSavePlanner(enable_plan_caching=True),
        )
    return (
        len(dist.distributed_c10d._world.pg_names),
        g.group_name if rank < 2 else None,
        h and h.group_name,
        _plan_caches(),
    )


def _look_at_state(rank, world):
    h = dist.new_group([0, 1, 2], use_local_synchronization=True) if rank < 3 else None
    return {
        "env": os.environ.get(LEAK_ENV),
        "host": os.environ.get("UCP_DCP_HOST"),
        "version": ucp_dcp.__version__,
        "key": ucp_dcp.CATALOG_KEY,
        "leaked": hasattr(ucp_dcp, "leaked_name"),
        "caches": _plan_caches(),
        "counter": list(_counter),
        "dtype": torch.get_default_dtype(),
        "randn": torch.randn(3).tolist(),
        "cwd": os.getcwd(),
        "groups": len(dist.distributed_c10d._world.pg_names) - (h is not None),
        "hashed": h and h.group_name,
    }


def _fresh_randn(rank, world):
    return torch.randn(3).tolist()


def test_a_task_leaves_no_state_for_the_next_one():
    fresh = D.run(_look_at_state, 4)
    left = D.run(_leave_state_behind, 4, D.tmpdir())
    assert [n for n, *_ in left] == [3, 3, 2, 1], left  # default group + the ones each rank is in
    assert any(left[0][3].values()), f"the cached saves filled no plan cache: {left[0][3]}"
    seen = D.run(_look_at_state, 4)
    for rank, (a, b) in enumerate(zip(fresh, seen)):
        assert b["env"] is None and b["host"] is None
        assert b["version"] == ucp_dcp.__version__ and b["key"] == ucp_dcp.CATALOG_KEY and not b["leaked"]
        assert not any(b["caches"].values()) and b["caches"] == a["caches"], b["caches"]
        assert b["counter"] == [] and b["dtype"] == torch.float32
        assert b["cwd"] == a["cwd"] and b["groups"] == a["groups"] == 1, "the task's groups are destroyed"
        if rank < 3:
            assert b["hashed"] != left[rank][2] and b["hashed"] != a["hashed"], "hashed names are per task"
        assert b["randn"] == a["randn"], "every task starts from a fresh process's RNG state"
    # and that state is the one a fresh process has
    assert D.run(_fresh_randn, 4) == D._run_fresh(_fresh_randn, 4, (), 120, "gloo")


def _dtensor_math(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))  # its dim groups are new groups of this task
    t = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0), Shard(1)])
    return (t * 2).full_tensor().tolist()


def test_dtensor_caches_do_not_hand_a_task_an_earlier_tasks_mesh():
    # DTensor caches sharding results by spec, and meshes compare equal across tasks: a cached output
    # spec from the first task would carry its mesh, whose groups are destroyed by now
    first = D.run(_dtensor_math, 4)
    assert D.run(_dtensor_math, 4) == first == [(torch.arange(8.0).reshape(4, 2) * 2).tolist()] * 4
