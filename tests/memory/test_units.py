"""The memory tier's pure parts: replica placement, the completion marker, the choice of a generation,
and who serves which fragment (no process group)."""

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ucp_dcp.errors import CheckpointNotFoundError, CorruptCheckpointError, InvalidArgumentError
from ucp_dcp.memory.hosts import replica_hosts
from ucp_dcp.memory.locate import choose
from ucp_dcp.memory.marker import Marker, decode_marker, encode_marker
from ucp_dcp.memory.serving import ServeRequest, assign_servers
from ucp_dcp.memory.store import HostHolding


@given(st.integers(1, 12), st.integers(0, 4))
def test_each_host_gets_k_distinct_replica_hosts_and_any_k_losses_leave_a_copy(n, k):
    hosts = [f"h{i}" for i in range(n)]
    with pytest.warns(UserWarning) if k > n - 1 else _nothing():
        ring = replica_hosts(hosts, k)
    kk = min(k, n - 1)
    for h, reps in ring.items():
        assert len(reps) == kk and len(set(reps)) == kk and h not in reps
    # every host keeps the replicas of exactly kk others: memory per host is (1 + kk) x its own pieces
    for h in hosts:
        assert sum(h in reps for reps in ring.values()) == kk


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_negative_replicas_are_refused():
    with pytest.raises(InvalidArgumentError):
        replica_hosts(["a", "b"], -1)


def test_a_marker_round_trips_and_a_flipped_byte_is_refused():
    m = Marker(3, "ab" * 16, {"__0_x_0.distcp": (10, "cd" * 16)}, {"__0_x_0.distcp": ["a", "b"]}, 1, 7)
    data = encode_marker(m)
    assert decode_marker(data, "m") == m
    bad = bytearray(data)
    bad[5] ^= 1
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        decode_marker(bytes(bad), "m")


def _holding(host, gen, files, wanted=None, complete=True, problem=None):
    wanted = wanted if wanted is not None else {"f0": 1, "f1": 1}
    return HostHolding(host, gen, "h", complete, wanted if complete else {}, dict.fromkeys(files, 1), {}, problem)


def test_the_freshest_complete_generation_is_chosen_and_an_incomplete_one_passed_over():
    holdings = [
        _holding("a", 2, ["f0"], complete=False, problem="no completion marker (replication did not finish)"),
        _holding("a", 1, ["f0", "f1"]),
        _holding("b", 1, ["f1"]),
    ]
    tier, gen, holders, notes = choose(holdings, durable=[])
    assert (tier, gen) == ("memory", 1) and holders == {"f0": ["a"], "f1": ["a", "b"]}
    assert "gen 2 (memory): incomplete" in notes[0] and "replication did not finish" in notes[0]


def test_a_generation_missing_a_piece_on_every_surviving_host_falls_back_to_the_durable_copy():
    tier, gen, _, notes = choose([_holding("a", 2, ["f0"])], durable=[1, 2])
    assert (tier, gen) == ("durable", 2) and "f1" in notes[0]


def test_a_fresher_durable_generation_wins():
    assert choose([_holding("a", 1, ["f0", "f1"])], durable=[2])[:2] == ("durable", 2)


def test_no_complete_generation_anywhere_is_refused_with_the_reasons():
    holdings = [_holding("a", 1, [], complete=False, problem="not committed (the save died during the host copy)")]
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint generation") as e:
        choose(holdings, durable=[])
    assert "died during the host copy" in str(e.value)


def _item(fqn):
    return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn), (0,), MetadataIndex(fqn, (0,)), (0,), (4,))


def test_every_fragment_is_served_by_a_rank_on_a_host_holding_its_file_least_loaded_first():
    reqs = [
        ServeRequest(0, [_item("w"), _item("v")], [3, 5], ["f1", "f1"], [100, 50]),
        ServeRequest(1),
        ServeRequest(2),
    ]
    plans = assign_servers(reqs, {"f1": ["b"]}, {0: "a", 1: "b", 2: "b"})
    assert plans[0].recv == {1: [[3]], 2: [[5]]}  # the second fragment goes to the less loaded holder
    assert [it.storage_index.fqn for m in plans[1].serve[0] for it in m] == ["w"]
    assert plans[0].served_bytes == 150 and not plans[0].serve


def test_a_load_whose_hosts_hold_everything_has_no_exchange():
    plans = assign_servers([ServeRequest(0), ServeRequest(1)], {"f1": ["a"]}, {0: "a", 1: "a"})
    assert all(not p.members and not p.serve and not p.recv for p in plans)


def test_a_drain_that_died_before_its_commit_is_cleaned_up_by_the_next_commit(tmp_path):
    from ucp_dcp.memory.drain import durable_dir, durable_folders, durable_generations, prune_durable
    from ucp_dcp.storage.commit import METADATA

    for gen, committed in ((1, True), (2, True), (3, False), (4, True)):  # gen 3's drain died before its commit
        os.makedirs(durable_dir(str(tmp_path), gen))
        with open(os.path.join(durable_dir(str(tmp_path), gen), "__0_x_0.distcp"), "wb") as f:
            f.write(b"x")
        if committed:
            open(os.path.join(durable_dir(str(tmp_path), gen), METADATA), "wb").close()
    assert durable_generations(str(tmp_path)) == [1, 2, 4]
    assert prune_durable(str(tmp_path), committed=4, keep=2) == [1, 3]
    assert durable_folders(str(tmp_path)) == [2, 4]
