"""The memory tier on simulated hosts (gloo ranks grouped by ``UCP_DCP_HOST``, each host with its own
store): the job dies at each step of a save, hosts are lost, and a job at another layout resumes from the
freshest complete tier, bitwise, or is refused. A stock ``dcp.load`` cannot do any of this: the pieces are
spread over host folders that no single checkpoint folder holds.

Save job: 4 ranks on 4 hosts (``node0..3``) at ``dp=2,tp=2``, k = 1 (node i's pieces on node i+1), a
durable folder; 2 generations, the second with the fault under test.
"""

import os
import shutil

import dist as D
import pytest

from ucp_dcp.errors import CheckpointNotFoundError
from ucp_dcp.memory import replicate
from ucp_dcp.memory.store import gen_dir
from ucp_dcp.storage.commit import METADATA
from ucp_dev.testing.memory_jobs import lose_hosts, resume_job, save_job, simulate_hosts

pytestmark = pytest.mark.slow
FOUR_HOSTS = "0,1,2,3"


def _save(rank, world, hosts, root, durable, topo, fault, saves):
    simulate_hosts(hosts)
    return save_job(topo, root, durable, fault=fault, saves=saves)


def _resume(rank, world, hosts, root, durable, topo, oracle):
    simulate_hosts(hosts)
    try:
        return resume_job(topo, root, durable, oracle)
    except CheckpointNotFoundError as e:
        return {"refused": str(e)}


def _damage(path):
    """Flip a byte every 4 KiB: bytes of the tensor records a load reads, not only headers it skips."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        for i in range(0, len(data), 4096):
            data[i] ^= 0x10
        f.seek(0)
        f.write(data)


def _save_damaged_in_transit(rank, world, hosts, root, topo):
    simulate_hosts(hosts)
    real = replicate._recv_file

    def faulty_link(g, src, name, k, group, *watch):  # the second generation's replicas arrive with a flipped byte
        header, buf = real(g, src, name, k, group, *watch)
        if g.gen == 2 and buf.numel():
            buf.numpy()[buf.numel() // 2] ^= 0x10
        return header, buf

    D.patch(replicate, "_recv_file", faulty_link)
    return save_job(topo, root, None)


def saved(fault=None, saves=2, durable=True, hosts=FOUR_HOSTS, topo="dp=2,tp=2"):
    root, disk = D.tmpdir(), (D.tmpdir() if durable else None)
    out = D.run(_save, len(hosts.split(",")), hosts, root, disk, topo, fault, saves)[0]
    return root, disk, out


def resume(root, disk, oracle, hosts, topo):
    return D.run(_resume, len(hosts.split(",")), hosts, root, disk, topo, oracle)[0]


@pytest.fixture(scope="module")
def two_generations():
    """The default save job's result, saved once for the tests that only damage or remove parts of it."""
    if not _SAVED:  # once per session, also if the module's items were not run back to back
        _SAVED.append(saved())
    return _SAVED[0]


_SAVED: list[tuple] = []


def copy_of(job):
    """A private copy of a saved job's memory root and durable folder (each test loses or damages its own)."""
    root, disk, out = job
    new_root, new_disk = D.tmpdir(), D.tmpdir()
    shutil.copytree(root, new_root, dirs_exist_ok=True)
    shutil.copytree(disk, new_disk, dirs_exist_ok=True)
    return new_root, new_disk, out


def test_a_lost_host_at_fewer_ranks_loads_the_last_generation_from_memory_with_peers_serving(two_generations):
    root, disk, out = copy_of(two_generations)
    assert [s["complete"] for s in out["statuses"]] == [True, True]
    lose_hosts(root, ["node1"])  # node1's pieces survive as node2's replica
    os.rename(disk, disk + ".gone")  # no durable read can happen
    res = D.run(_resume_counting_mapped, 2, "0,2", root, disk, "tp=2", out["oracles"][1])
    got, served = res[0][0], [c for _, c in res]
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 2, [])
    assert all(received > 0 for _, received in got["bytes"])  # each rank got fragments its host lacks
    assert all(c["sent"] > 0 for c in served)  # whole records sent from the servers' mappings of their files


def test_no_complete_generation_anywhere_is_refused():
    root, disk, out = saved(fault="replicate", saves=1, durable=False)
    got = resume(root, disk, None, "0,1", "tp=2")
    assert "no complete checkpoint generation" in got["refused"] and "replication did not finish" in got["refused"]


def test_a_corrupt_replica_of_a_lost_hosts_piece_is_caught_and_the_durable_copy_loaded(two_generations):
    root, disk, out = copy_of(two_generations)
    lose_hosts(root, ["node1"])
    folder = gen_dir(root, "node2", 2)
    replica = next(n for n in sorted(os.listdir(folder)) if n.startswith("__1_"))
    _damage(os.path.join(folder, replica))  # same size: only the block checksums of the load can tell
    got = resume(root, disk, out["oracles"][1], "0,2", "tp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("durable", 2, [])
    assert "found damaged during the load" in got["notes"][0]
    assert any("node2's copy of " + replica in n and "damaged" in n for n in got["notes"])


@pytest.mark.full  # make test keeps the damaged replica caught (above); this is its other-host variant
def test_a_copy_found_damaged_during_the_load_is_passed_over_for_another_hosts_copy(two_generations):
    root, disk, out = copy_of(two_generations)
    folder = gen_dir(root, "node0", 2)
    own = next(n for n in sorted(os.listdir(folder)) if n.startswith("__0_"))
    _damage(os.path.join(folder, own))  # node1 keeps the replica of node0's pieces
    os.rename(disk, disk + ".gone")  # no durable read can happen
    got = resume(root, disk, out["oracles"][1], FOUR_HOSTS, "tp=4")  # a process crash, another TP split
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 2, [])
    assert "found damaged during the load" in got["notes"][0]
    assert any("node0's copy of " + own in n for n in got["notes"])


def test_a_replica_damaged_in_transit_leaves_its_generation_incomplete_and_the_one_before_loads():
    root = D.tmpdir()
    out = D.run(_save_damaged_in_transit, 2, "0,1", root, "tp=2")[0]
    assert [s["complete"] for s in out["statuses"]] == [True, False]
    assert "arrived damaged" in out["statuses"][1]["error"]
    got = resume(root, None, out["oracles"][0], "0,1", "tp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 1, [])
    assert any("gen 2 (memory): incomplete" in n for n in got["notes"])


# -- the rest of the matrix: make test-full ---------------------------------------------------------------

FULL = pytest.mark.full


@FULL
@pytest.mark.parametrize(
    "fault, gen",
    [
        ("copy", 1),  # died during the host copy: gen 2 has data files but no commit
        ("replicate", 1),  # died during replication: gen 2 has no completion marker
        ("complete", 2),  # died right after the marker: gen 2 complete in memory, not drained
        ("drain", 2),  # died during the drain: memory gen 2 complete, its durable copy uncommitted
    ],
)
def test_the_job_dies_at_a_step_a_host_is_lost_and_another_tp_split_resumes_bitwise(fault, gen):
    root, disk, out = saved(fault=fault)
    lose_hosts(root, ["node3"])
    got = resume(root, disk, out["oracles"][gen - 1], "0,1,2,0", "tp=4")
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", gen, [])
    if gen == 1:
        assert any("gen 2" in n for n in got["notes"])


@FULL
def test_two_lost_hosts_with_one_replica_fall_back_to_the_durable_copy(two_generations):
    root, disk, out = copy_of(two_generations)
    lose_hosts(root, ["node1", "node2"])  # node1's pieces were only on node1 and node2
    got = resume(root, disk, out["oracles"][1], "0,3", "dp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("durable", 2, [])


@FULL
def test_two_lost_hosts_in_the_drain_fault_fall_back_to_the_last_drained_generation():
    root, disk, out = saved(fault="drain")
    lose_hosts(root, ["node1", "node2"])
    got = resume(root, disk, out["oracles"][0], "0,3", "dp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("durable", 1, [])


@FULL
def test_a_missing_replica_is_caught(two_generations):
    root, disk, out = copy_of(two_generations)
    lose_hosts(root, ["node1"])
    folder = gen_dir(root, "node2", 2)
    os.remove(os.path.join(folder, next(n for n in sorted(os.listdir(folder)) if n.startswith("__1_"))))
    got = resume(root, disk, out["oracles"][1], "0,2", "tp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("durable", 2, [])


@FULL
def test_more_ranks_on_a_new_empty_host_get_every_fragment_from_peers():
    root, disk, out = saved(hosts="0,1", topo="tp=2")
    lose_hosts(root, ["node1"])
    got = resume(root, None, out["oracles"][1], "0,0,5,5", "dp=2,tp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 2, [])
    assert got["bytes"][2][0] == 0 and got["bytes"][2][1] > 0  # node5 holds nothing: it read nothing


@FULL
def test_a_process_crash_restarts_on_the_same_hosts_from_their_own_memory():
    root, disk, out = saved(fault="complete")
    got = resume(root, None, out["oracles"][1], FOUR_HOSTS, "dp=2,tp=2")
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 2, [])
    assert all(read > 0 for read, _ in got["bytes"])  # every rank reads its own host's memory


@FULL
def test_a_lost_host_restarts_at_a_pipeline_split_from_memory(two_generations):
    root, disk, out = copy_of(two_generations)
    lose_hosts(root, ["node3"])
    os.rename(disk, disk + ".gone")
    got = resume(root, disk, out["oracles"][1], "0,2", "pp=2")  # node0: pieces of 0 and 3; node2: of 2 and 1
    assert (got["tier"], got["generation"], got["diffs"]) == ("memory", 2, [])


@FULL
def test_a_drain_that_died_before_its_commit_is_removed_by_the_next_jobs_drain():
    root, disk, out = saved(fault="drain")
    assert sorted(os.listdir(disk)) == ["gen-00000001", "gen-00000002"]
    assert not os.path.exists(os.path.join(disk, "gen-00000002", METADATA))
    again = D.run(_save, 4, FOUR_HOSTS, root, disk, "dp=2,tp=2", None, 1)[0]
    assert again["statuses"][0]["gen"] == 3 and again["statuses"][0]["drained"]
    assert sorted(os.listdir(disk)) == ["gen-00000001", "gen-00000003"]


def _resume_counting_mapped(rank, world, hosts, root, durable, topo, oracle):
    """``_resume``, counting this rank's fragments served from a mapping: sent, or refused by its checksums."""
    from ucp_dcp.errors import CorruptCheckpointError
    from ucp_dcp.memory.reader import MemoryReader

    real = MemoryReader._serve_mapped
    count = {"sent": 0, "refused": 0}

    def counting(self, item):
        try:
            out = real(self, item)
        except CorruptCheckpointError:
            count["refused"] += 1
            raise
        count["sent"] += out is not None
        return out

    D.patch(MemoryReader, "_serve_mapped", counting)
    return _resume(rank, world, hosts, root, durable, topo, oracle), count


def test_a_damaged_copy_served_from_a_mapping_is_caught_before_it_is_sent(two_generations):
    """node0's rank needs rank 2's pieces, which node2 holds (its replica host node3 is not in the restart):
    node2 serves them from a mapping of its file, whose bytes were damaged in memory; its block checksums
    refuse them before sending, and the restart reads the durable copy instead."""
    root, disk, out = copy_of(two_generations)
    lose_hosts(root, ["node1"])
    folder = gen_dir(root, "node2", 2)
    own = next(n for n in sorted(os.listdir(folder)) if n.startswith("__2_"))
    _damage(os.path.join(folder, own))
    res = D.run(_resume_counting_mapped, 2, "0,2", root, disk, "tp=2", out["oracles"][1])
    got, served = res[0][0], res[1][1]
    assert (got["tier"], got["generation"], got["diffs"]) == ("durable", 2, [])
    assert served["refused"] >= 1 and "found damaged during the load" in got["notes"][0]
