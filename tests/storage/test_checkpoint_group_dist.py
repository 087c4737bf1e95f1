"""DCP's collectives on the checkpoint group (issues 32, 45): a rank that dies outside ``read_data`` -- while DCP
plans a save or a load, while it writes, before the commit -- ends every survivor with a ``PeerLostError``
naming it within about the peer timeout, not the process group's; a save in flight never commits. Normal
saves and loads go through the group -- gloo, behind the gates -- round-trip bitwise, and leave no key in the
job's store. The gates in one process: tests/planning/test_watch.py.

Deaths run in fresh processes (``ucp_dev.testing.chaos.run_case``: PG timeout 300 s, far above the bound);
the round trips on the pool (a hang there fails at ``HANG_S``, below the pool's 180 s PG timeout).
"""

import dist as D
import pytest
import torch
import torch.distributed as dist

from ucp_dcp.api import load, save
from ucp_dcp.planning import checkpoint_group as cg
from ucp_dev.testing.chaos import Case, judge, one_rank, previous, run_case

HANG_S = 90
PEER_TIMEOUT_S = 3.0


def _state(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(seed))
    rows = w.shape[0] // world
    local = DTensor.from_local(w[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)
    return {"w": local, "b": torch.arange(5.0) + seed, "step": seed}, w


def _round_trip(rank, world, root, control):
    if not control:
        D.setenv(cg.CONTROL_ENV, "off")
    sd, w = _state(rank, world, 3)
    save(sd, root)
    group = cg.checkpoint_group(list(range(world))) if control else None
    calls_save = (group.watch.calls, group.watch.seq) if group else (0, 0)
    got = {"w": torch.zeros_like(w), "b": torch.zeros(5), "step": 0}
    load(got, root)
    calls = (group.watch.calls, group.watch.seq) if group else (0, 0)
    dist.barrier()
    left = (_keys_left(group.watch) + _rendezvous_left(group)) if group else []
    return calls_save, calls, left, torch.equal(got["w"], w), torch.equal(got["b"], sd["b"]), got["step"]


def _keys_left(watch):
    """Which keys any call of ``watch`` could have made still exist in the job's store."""
    names = ["left"] + [f"b/{r}" for r in range(watch.size)]
    names += [f"{x}/{k}" for k in range(1, watch.seq + 3) for x in ("a", "g")]
    keys = [f"ucp_dcp/{watch.name}/{call}/{n}" for call in range(1, watch.calls + 1) for n in names]
    return [k for k in keys if watch._store.check([k])]


def _rendezvous_left(group):
    """Which members' gloo rendezvous keys (``0/<group rank>`` under the group's prefix) are still there."""
    from ucp_dcp._compat import default_store

    store = dist.PrefixStore(f"checkpoint_group/{group.key}/", default_store())
    return [f"rendezvous 0/{r}" for r in range(group.size()) if store.check([f"0/{r}"])]


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.full), 4])
def test_save_and_load_go_through_the_checkpoint_group_round_trip_bitwise_and_leave_no_key(world):
    res = D.run(_round_trip, world, D.tmpdir(), True, timeout=HANG_S)
    for (calls_save, gates_save), (calls, gates), left, w_equal, b_equal, step in res:
        assert w_equal and b_equal and step == 3, res
        # DCP's collectives ran on the checkpoint group, each behind a gate: one call per save and load
        assert calls_save == 1 and calls == 2 and gates_save > 0 and gates > 0, res
        assert left == [], res  # no key of either call left in the job's store, nor the group's gloo rendezvous


def _uneven_groups_worker(rank, world, root):
    """Rank 0 holds a group the others are not in (c10d then names a locally synchronized group differently
    on it): the checkpoint group's members must still meet, and the one made again after a failed call too."""
    dist.new_group([0])
    sd, w = _state(rank, world, 5)
    save(sd, root)
    first = cg.checkpoint_group(list(range(world)))
    first.spent = True  # as after a call that raised: the next call makes the group again
    got = {"w": torch.zeros_like(w), "b": torch.zeros(5), "step": 0}
    load(got, root)
    again = cg.checkpoint_group(list(range(world)))
    return first.key, again.key, again is not first, torch.equal(got["w"], w), got["step"]


def test_groups_the_others_do_not_hold_and_a_group_made_again_do_not_keep_members_apart():
    res = D.run(_uneven_groups_worker, 4, D.tmpdir(), timeout=HANG_S)
    assert all(r[2:] == (True, True, 5) for r in res), res
    # every member named both makings alike (their rendezvous prefix and watch keys), and the two apart
    assert len({r[0] for r in res}) == 1 and len({r[1] for r in res}) == 1 and res[0][0] != res[0][1], res


def _off_worker(rank, world, root):
    sd, _ = _state(rank, world, 1)
    D.setenv(cg.CONTROL_ENV, "off")
    save(sd, root)
    return len(cg._GROUPS)


def test_the_checkpoint_group_can_be_turned_off():
    assert D.run(_off_worker, 2, D.tmpdir(), timeout=HANG_S) == [0, 0]


def _raise_case_worker(rank, world, root, fault):
    return one_rank(Case(world, fault, peer_timeout=PEER_TIMEOUT_S), rank, root)


@pytest.mark.parametrize("fault", ["raise@save-plan", "raise@written"])
def test_a_save_step_that_raises_ends_every_rank_with_the_cause_and_commits_nothing(fault):
    root = D.tmpdir()
    case = Case(4, fault, peer_timeout=PEER_TIMEOUT_S)
    res = dict(enumerate(D.run(_raise_case_worker, 4, root, fault, timeout=HANG_S)))
    assert not judge(case, res, previous(case, root)), (judge(case, res, previous(case, root)), res)
    assert res[3]["error"] == "FaultInjected" and all(r["peer"] == 3 for k, r in res.items() if k != 3), res


# -- a rank that dies or freezes: fresh processes ------------------------------------------------------------


def _lost(fault, world=4):
    out = run_case(Case(world, fault, peer_timeout=PEER_TIMEOUT_S))
    assert out.ok, (out.problems, out.hangs, out.aborts, out.results)
    for r, rep in out.results.items():
        assert rep["error"] == "PeerLostError" and rep["peer"] == world - 1, (r, rep)
        assert rep["seconds"] < out.case.bound, (r, rep)
    return out


@pytest.mark.slow
@pytest.mark.full  # waits out the peer timeout in fresh processes: CI's e2e core runs it (the chaos sample)
def test_a_rank_killed_after_writing_its_data_never_lets_the_save_commit():
    out = _lost("exit@written")
    assert out.previous == "previous"  # the folder still loads, bitwise, as the checkpoint saved before
    assert all("its last step: save: written" in rep["message"] for rep in out.results.values()), out.results


@pytest.mark.slow
@pytest.mark.full  # each waits out the peer timeout in fresh processes: make test-full and make chaos run them
@pytest.mark.parametrize("fault", ["exit@save-plan", "exit@write", "exit@load-plan", "hang@save-plan"])
def test_a_rank_that_dies_or_freezes_outside_read_data_is_named_by_every_survivor(fault):
    out = _lost(fault)
    assert not out.case.in_save or out.previous == "previous"


@pytest.mark.slow
@pytest.mark.full
def test_a_two_rank_load_whose_other_rank_dies_while_planning_ends():
    _lost("exit@load-plan", world=2)


# -- restart in one process -----------------------------------------------------------------------------------


def _restart_worker(rank, world, root):
    seqs = []
    for gen, (me, size, store) in enumerate([(world - 1 - rank, world, "b"), (rank % 2, 2, f"c{rank // 2}")]):
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{root}/store-{store}", rank=me, world_size=size)
        sd, w = _state(me, size, gen)
        save(sd, f"{root}/{store}")
        got = {"w": torch.zeros_like(w), "b": torch.zeros(5), "step": -1}
        load(got, f"{root}/{store}")
        assert torch.equal(got["w"], w) and got["step"] == gen
        seqs.append(cg.checkpoint_group(list(range(size))).watch.calls)  # this generation's group did the work
    return seqs


@pytest.mark.slow
@pytest.mark.full  # fresh processes; make test's test_destroy_and_init_process_group_then_load_again_in_the_same_process
# (tests/storage/test_peer_failures.py) restarts through the checkpoint group too
def test_destroy_and_init_then_save_and_load_again_on_a_new_checkpoint_group():
    res = D.run(_restart_worker, 4, D.tmpdir(), timeout=HANG_S, backend="cpu:gloo")
    assert all(len(s) == 2 and all(n > 0 for n in s) for s in res), res
