"""The watch's gates in one process: members are threads over one HashStore (issue 45).

A gate opens when every member arrives, with a few store requests per member whatever the number of
members, and a finished or failed call leaves no key behind; a member whose beat stands still is lost
within the peer timeout and every member ends naming it (the coordinator found by its deputy); a slow
member whose beat moves is waited for; a member that never begins is named after the wait limit; a
member that arrives failing ends the call with its own error, or with the lost rank's name when one
is lost; nothing is sent between calls. The same gates under DCP, across processes:
tests/storage/test_checkpoint_group_dist.py.
"""

import threading
import time

import pytest
import torch.distributed as dist

from ucp_dcp.errors import PeerFailedError, PeerLostError
from ucp_dcp.planning import checkpoint_group as W
from ucp_dcp.planning.checkpoint_group import Watch, call_requests

MEMBERS = [10, 11, 12]  # global ranks: errors name these, not the positions


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setenv("UCP_DCP_PEER_TIMEOUT_S", "0.6")
    monkeypatch.setenv("UCP_DCP_BEAT_S", "0.05")
    monkeypatch.setattr(W, "SCAN_S", 0.1)


class Counting:
    """The store, counting each member's requests (one proxy per member)."""

    def __init__(self, store):
        self.store, self.n, self.ops = store, 0, {}

    def __getattr__(self, op):
        def call(*args):
            self.n += 1
            self.ops[op] = self.ops.get(op, 0) + 1
            return getattr(self.store, op)(*args)

        return call


def _watches(store, wait_limit=30.0, n=3):
    return [Watch("g", MEMBERS[:n], r, wait_limit, store=Counting(store)) for r in range(n)]


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


def test_gates_open_for_every_member_with_a_few_requests_each_and_leave_no_key(fast):
    store = dist.HashStore()
    ws = _watches(store)

    def call(r):
        with ws[r].running("save"):
            for k in range(20):
                ws[r].gate(f"save: op {k}")
        return ws[r].seq

    assert _on_threads(call, range(3)) == {0: 20, 1: 20, 2: 20}
    assert store.num_keys() == 0  # every key of the call removed by the last rank out
    # the member that only waits (not a watcher): per gate its beat, one add and one blocking get, never
    # a poll; when it is the last to arrive it opens the gate and drops the last gate's two keys; one add
    # on the way out (and the clean-up, if last). O(1) per gate whatever the number of members
    ops = ws[2]._store.ops
    assert ops["get"] == 20 and ops["add"] == 21 and "check" not in ops and "multi_get" not in ops, ops
    assert ops.get("compare_set", 0) <= 20 and ops["set"] >= 21, ops
    # the model `ucp_dcp plan` prints: every member's adds and the verdicts, exactly
    model = call_requests(3, 20)
    assert sum(w._store.ops["add"] for w in ws) == model["arrivals (add)"] + model["leaving (add)"]
    assert sum(w._store.ops.get("compare_set", 0) for w in ws) == model["verdicts (compare_set)"]


def test_nothing_is_sent_between_calls(fast):
    store = dist.HashStore()
    ws = _watches(store)
    _on_threads(lambda r: ws[r].running("save").__enter__() and None, range(3))  # a call begun ...
    _on_threads(lambda r: ws[r].end(None), range(3))  # ... and ended on every member
    before = [w._store.n for w in ws]
    time.sleep(0.5)  # ten beat intervals
    assert [w._store.n for w in ws] == before and store.num_keys() == 0


def _frozen_member(ws, frozen):
    def call(r):
        if r == frozen:  # it begins, then its beat stops, as a frozen process's would (and it is killed)
            ws[r].begin("load")
            ws[r].stop()
            return "frozen"
        with ws[r].running("load"):
            ws[r].gate("load: gather")
        return "passed"

    return call


@pytest.mark.parametrize(
    "frozen", [2, 0], ids=["a member (found by the coordinator)", "the coordinator (by its deputy)"]
)
def test_a_member_whose_beat_stands_still_is_lost_and_every_member_ends_naming_it(fast, frozen):
    store = dist.HashStore()
    ws = _watches(store)
    out = _on_threads(_frozen_member(ws, frozen), range(3))
    for r in set(range(3)) - {frozen}:
        assert isinstance(out[r], PeerLostError) and out[r].rank == MEMBERS[frozen], out
        # ended by the beat standing still (the 0.6 s peer timeout), not by the 30 s wait limit, whose error
        # says "did not reach the collective within the group's timeout" (no wall-clock bound: CI machines stall)
        assert "no heartbeat" in str(out[r]) and "load: start" in str(out[r]), out[r]
        assert "group's timeout" not in str(out[r]), out[r]
    assert store.num_keys() == 0  # the lost member's keys too


def test_a_slow_member_whose_beat_moves_is_waited_for(fast):
    store = dist.HashStore()
    ws = _watches(store)

    def call(r):
        with ws[r].running("save"):
            if r == 2:
                time.sleep(2.0)  # over three peer timeouts of work, beating all along
            ws[r].gate("save: gather")
        return "passed"

    assert _on_threads(call, range(3)) == {0: "passed", 1: "passed", 2: "passed"}
    assert store.num_keys() == 0


def test_a_member_that_never_begins_is_named_after_the_wait_limit(fast):
    store = dist.HashStore()
    ws = _watches(store, wait_limit=1.0)

    def call(r):
        with ws[r].running("save"):
            ws[r].gate("save: gather")

    out = _on_threads(call, [0, 1])
    assert all(isinstance(e, PeerLostError) and e.rank == 12 for e in out.values()), out
    assert "never began this call" in str(out[0]) and "group's timeout (1 s" in str(out[0]), out[0]


def test_a_failing_arrival_ends_the_call_with_its_error_on_every_member(fast):
    store = dist.HashStore()
    ws = _watches(store)
    boom = RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    def call(r):
        with ws[r].running("load"):
            ws[r].gate("load: allgather", error=boom if r == 1 else None)

    out = _on_threads(call, range(3))
    assert out[1] is boom, out  # its own error, in full
    for r in (0, 2):
        assert isinstance(out[r], PeerFailedError) and isinstance(out[r], RuntimeError), out
        assert out[r].rank == 11 and "rank 11 failed: RuntimeError: Connection closed" in str(out[r]), out[r]
    assert store.num_keys() == 0


def test_a_failing_arrival_waits_for_the_lost_rank_to_be_named(fast):
    """A gloo error on one rank is a symptom: the rank that froze is what every rank names."""
    store = dist.HashStore()
    ws = _watches(store)

    def call(r):
        if r == 2:  # frozen, then killed: it never reaches the gate nor leaves
            ws[r].begin("load")
            ws[r].stop()
            return None
        with ws[r].running("load"):
            ws[r].gate("load: allgather", error=RuntimeError("Timed out waiting 600ms") if r == 1 else None)

    out = _on_threads(call, range(3))
    assert all(isinstance(out[r], PeerLostError) and out[r].rank == 12 for r in (0, 1)), out
    assert store.num_keys() == 0


def test_an_error_only_this_rank_had_ends_the_others_at_their_gate(fast):
    store = dist.HashStore()
    ws = _watches(store)

    def call(r):
        with ws[r].running("save"):
            if r == 2:
                raise ValueError("bad input on this rank, outside DCP's steps")
            ws[r].gate("save: gather")

    out = _on_threads(call, range(3))
    assert isinstance(out[2], ValueError) and not isinstance(out[2], PeerFailedError), out
    assert all(isinstance(out[r], ValueError) and out[r].rank == 12 for r in (0, 1)), out
    assert store.num_keys() == 0


def test_a_later_call_starts_clean_after_a_failed_one(fast):
    store = dist.HashStore()
    ws = _watches(store)

    def failed(r):
        with ws[r].running("save"):
            if r == 1:
                raise OSError("disk full, on this rank only")
            ws[r].gate("save: gather")

    assert all(isinstance(e, OSError) for e in _on_threads(failed, range(3)).values())
    assert store.num_keys() == 0

    def call(r):
        with ws[r].running("load"):
            ws[r].gate("load: gather")
        return (ws[r].verdict, ws[r].lost, ws[r].failing, ws[r].seq, ws[r].calls)

    assert _on_threads(call, range(3)) == {r: (None, [], "", 1, 2) for r in range(3)}
    assert store.num_keys() == 0
