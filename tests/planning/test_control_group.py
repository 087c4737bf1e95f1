"""The control group's collectives through a store, in one process: members are threads over one HashStore.

What DCP's object collectives are made of (allgather, gather, broadcast, scatter, barrier, allreduce) gives
gloo's results and leaves no key behind but the heartbeats; a member whose heartbeat stands still is lost
within the peer timeout, and every member ends -- also those waiting on someone else; a slow member whose
heartbeat moves is waited for. The same group under DCP, across processes: tests/storage/test_control_group_dist.py.
"""

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ucp_dcp.errors import PeerLostError, UCPError
from ucp_dcp.planning import control_group as cg
from ucp_dcp.planning.control_group import ControlGroup

MEMBERS = [10, 11, 12]  # global ranks: errors name these, not the group ranks


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setenv("UCP_DCP_PEER_TIMEOUT_S", "0.6")
    monkeypatch.setenv("UCP_DCP_BEAT_S", "0.05")
    monkeypatch.setattr(cg, "SCAN_S", 0.1)


def _groups(store, timeout_s=60.0):
    return [ControlGroup(dist.PrefixStore("g/", store), r, 3, timedelta(seconds=timeout_s), MEMBERS) for r in range(3)]


def _on_threads(fn, ranks):
    out: dict[int, object] = {}

    def run(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # the result under test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a member hung"
    return out


def _ops(g, r):
    root = SimpleNamespace(rootRank=1)
    mine = torch.tensor([r + 1.0, 2.0 * r])
    everyone = [torch.zeros(2) for _ in range(3)]
    g.allgather([everyone], [mine])
    gathered = [torch.zeros(2) for _ in range(3)] if r == 1 else []
    g.gather([gathered] if r == 1 else [], [mine], root)
    sent = torch.tensor([r * 10 + 5], dtype=torch.long)
    g.broadcast([sent], root)
    part = torch.zeros(3, dtype=torch.uint8)
    g.scatter([part], [[torch.full((3,), k, dtype=torch.uint8) for k in range(3)]] if r == 1 else [], root)
    g.barrier()
    total = torch.tensor([r + 1])
    g.allreduce([total], SimpleNamespace(reduceOp=dist.ReduceOp.MAX))
    return everyone, gathered, sent, part, total


def test_the_collectives_give_gloos_results_and_leave_only_the_heartbeats(fast):
    store = dist.HashStore()
    groups = _groups(store)
    out = _on_threads(lambda r: _ops(groups[r], r), range(3))
    rows = [torch.tensor([r + 1.0, 2.0 * r]) for r in range(3)]
    for r in range(3):
        everyone, gathered, sent, part, total = out[r]
        assert all(torch.equal(a, b) for a, b in zip(everyone, rows))
        assert r != 1 or all(torch.equal(a, b) for a, b in zip(gathered, rows))
        assert sent.item() == 15 and torch.equal(part, torch.full((3,), r, dtype=torch.uint8)) and total.item() == 3
    assert store.num_keys() == 3, "an op left keys in the store"  # the three heartbeats
    for g in groups:
        g.stop()


def test_a_lost_member_ends_every_member_with_its_rank_and_step(fast, monkeypatch):
    monkeypatch.setattr(cg, "_STEP", ["save", "writing"])  # what the members' heartbeats announce
    store = dist.HashStore()
    groups = _groups(store)
    groups[2].stop()  # frozen after its first beat
    root = SimpleNamespace(rootRank=0)

    def step(r):
        g = groups[r]
        g.gather([[torch.zeros(1) for _ in range(3)]] if r == 0 else [], [torch.ones(1)], root)  # 0 waits for 2
        g.broadcast([torch.zeros(1)], root)  # 1 waits for 0, which never sends: told through the store
        return "finished"

    t0 = time.monotonic()
    out = _on_threads(step, [0, 1])
    assert time.monotonic() - t0 < 6
    for r in (0, 1):
        err = out[r]
        assert isinstance(err, PeerLostError) and err.rank == 12, out
        assert "rank 12 stopped answering during a save" in str(err) and "its last step: save writing" in str(err)
    assert "seen by rank 10" in str(out[1])
    with pytest.raises(PeerLostError, match="rank 12"):  # the group is spent
        groups[0].barrier()
    for g in groups:
        g.stop()


def test_a_slow_member_whose_heartbeat_moves_is_waited_for(fast):
    groups = _groups(dist.HashStore())

    def late(r):
        if r == 2:
            time.sleep(1.5)  # 2.5 peer timeouts, beating all along
        groups[r].barrier()
        return "ok"

    assert _on_threads(late, range(3)) == {0: "ok", 1: "ok", 2: "ok"}
    for g in groups:
        g.stop()


def test_a_member_that_never_joins_is_lost_after_the_groups_timeout(fast):
    store = dist.HashStore()
    groups = [ControlGroup(dist.PrefixStore("g/", store), r, 3, timedelta(seconds=0.8), MEMBERS) for r in range(2)]
    out = _on_threads(lambda r: groups[r].barrier(), [0, 1])
    assert all(isinstance(e, PeerLostError) and e.rank == 12 and "never joined" in str(e) for e in out.values()), out
    for g in groups:
        g.stop()


def test_ranks_that_call_different_collectives_are_told_not_fed_garbage(fast):
    groups = _groups(dist.HashStore())

    def mixed(r):
        if r == 0:
            return groups[r].barrier()
        return groups[r].allgather([[torch.zeros(1) for _ in range(3)]], [torch.ones(1)])

    out = _on_threads(mixed, range(3))
    assert all(isinstance(e, UCPError) and "different orders" in str(e) for e in out.values()), out
    for g in groups:
        g.stop()
