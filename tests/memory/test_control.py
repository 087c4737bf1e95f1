"""The memory tier's collectives on checkpoint groups (issues 36, 45): a failure on one rank during a memory save's
replication or a memory load's choice ends every rank with an error naming that rank, instead of leaving the
others in a gloo collective until its timeout; a rank lost in the background work (its beat stands
still) ends every other rank with a ``PeerLostError`` within the peer timeout. Two simulated hosts
(``UCP_DCP_HOST``) of the shared gloo pool, one rank each."""

import importlib
import time

import dist as D
import pytest
import torch

from ucp_dcp.errors import PeerLostError, UCPError
from ucp_dcp.memory import MemoryTier, replicate
from ucp_dcp.memory import load as memory_load
from ucp_dcp.planning import checkpoint_group as cg

pytestmark = pytest.mark.slow

HANG_S = 90  # the pool's gloo timeout is 180 s: a test that waits this long failed
PEER_TIMEOUT_S = "3"


def _state(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = torch.randn(world * 8, 16, generator=torch.Generator().manual_seed(seed))
    rows = w.shape[0] // world
    return {"w": DTensor.from_local(w[rank * rows : (rank + 1) * rows].clone(), mesh, [Shard(0)], run_check=False)}


def _on_host(rank):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    D.setenv("UCP_DCP_PEER_TIMEOUT_S", PEER_TIMEOUT_S)


def _replication_fails_on_rank_1(rank, world, root):
    _on_host(rank)
    real = replicate._read_file

    def unreadable(path, size):  # rank 1 cannot read its own file of generation 1 (a tmpfs fault)
        if rank == 1 and "gen-00000001" in path:
            raise OSError(f"simulated read failure of {path}")
        return real(path, size)

    D.patch(replicate, "_read_file", unreadable)
    out = []
    with MemoryTier(root, replicas=1) as tier:
        for seed in (1, 2):
            tier.save(_state(rank, world, seed), step=seed)
            s = tier.wait()
            out.append((s.complete, None if s.error is None else f"{type(s.error).__name__}: {s.error}"))
        ops = cg.checkpoint_group([0, 1]).watch.calls
    return out, ops


def test_a_replication_failure_on_one_rank_ends_the_generation_on_every_rank_naming_it():
    res = D.run(_replication_fails_on_rank_1, 2, D.tmpdir(), timeout=HANG_S)
    for rank, (out, ops) in enumerate(res):
        assert out[0][0] is False and out[1] == (True, None), (rank, out)  # the protocol stayed in step
        assert ops > 0, "the tier's saves ran DCP's collectives on the checkpoint group"
    assert res[1][0][0][1].startswith("OSError: simulated read failure"), res[1]
    assert "rank 1" in res[0][0][0][1] and "simulated read failure" in res[0][0][0][1], res[0]


def _locate_fails_on_rank_1(rank, world, root):
    _on_host(rank)
    with MemoryTier(root, replicas=1) as tier:
        tier.save(_state(rank, world, 1), step=1)
    locate = importlib.import_module("ucp_dcp.memory.locate")  # the package exports the function under that name
    real = locate.inspect_host

    def broken(*args, **kwargs):
        if rank == 1:
            raise OSError("simulated: the host's store cannot be listed")
        return real(*args, **kwargs)

    D.patch(locate, "inspect_host", broken)
    got = {"w": torch.zeros_like(_state(rank, world, 1)["w"])}
    try:
        memory_load(got, root)
    except UCPError as e:
        return f"{type(e).__name__}: {e}"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_a_failure_on_one_rank_while_choosing_the_source_ends_every_rank_naming_it():
    res = D.run(_locate_fails_on_rank_1, 2, D.tmpdir(), timeout=HANG_S)
    assert res[1].startswith("OSError: simulated"), res
    assert "rank 1" in res[0] and "simulated" in res[0], res


def _frozen_in_replication(rank, world, root):
    _on_host(rank)
    holder = {}
    real = replicate._read_file

    def freeze(path, size):  # rank 1's background work stops answering (as a frozen process) in generation 2
        if rank == 1 and "gen-00000002" in path and "frozen" not in holder:
            holder["frozen"] = True
            watch = holder["tier"]._ctl.watch
            beat = watch._beat
            watch._beat = lambda *a, **k: None  # its beats stop, as a frozen process's do ...
            time.sleep(3 * float(PEER_TIMEOUT_S))
            watch._beat = beat  # ... and go on when it resumes (the others ended the call without it)
        return real(path, size)

    D.patch(replicate, "_read_file", freeze)
    tier = MemoryTier(root, replicas=1)
    holder["tier"] = tier
    tier.save(_state(rank, world, 1), step=1)
    tier.save(_state(rank, world, 2), step=2)
    s = tier.wait()
    try:
        tier.save(_state(rank, world, 3), step=3)
        again = "saved"
    except PeerLostError as e:
        again = f"PeerLostError rank {e.rank}"
    tier.close()
    return type(s.error).__name__, getattr(s.error, "rank", None), again, s.complete


@pytest.mark.full
def test_a_rank_lost_during_replication_ends_every_rank_with_a_peer_lost_error():
    res = D.run(_frozen_in_replication, 2, D.tmpdir(), timeout=HANG_S)
    assert res[0] == ("PeerLostError", 1, "PeerLostError rank 1", False), res
    assert res[1][0] == "PeerLostError" and res[1][3] is False, res
