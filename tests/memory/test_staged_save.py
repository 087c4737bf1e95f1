"""A staged memory save (``MemoryTier(staging="buffered")``, the default): the caller gets control back
after the copy into the staging buffers and changes its state at once, as training does, while the
background plans, writes and commits the generation; the generation holds the state as it was at the
save, bitwise. Two simulated hosts of the shared gloo pool, one rank each."""

import dist as D
import pytest
import torch

from ucp_dcp.memory import MemoryTier
from ucp_dcp.memory import load as memory_load

pytestmark = pytest.mark.slow


def _state(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = torch.randn(world * 64, 32, generator=torch.Generator().manual_seed(seed))
    rows = w.shape[0] // world
    local = w[rank * rows : (rank + 1) * rows].clone()
    return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False), "step": seed}


def _save_then_train(rank, world, root, staging):
    D.setenv("UCP_DCP_HOST", f"node{rank}")
    sd = _state(rank, world, 1)
    with MemoryTier(root, replicas=1, staging=staging) as tier:
        tier.save(sd, step=1)
        first = tier.wait()
        sd = _state(rank, world, 2)
        tier.save(sd, step=2)
        sd["w"].to_local().add_(1000.0)  # the next step, before the background has written generation 2
        sd["step"] = 3
        second = tier.wait()
        staged = tier.staged_bytes
    got = {"w": torch.zeros_like(_state(rank, world, 2)["w"]), "step": -1}
    memory_load(got, root)
    want = _state(rank, world, 2)["w"].to_local()
    return (
        first.complete,
        second.complete,
        repr(second.error),
        staged,
        torch.equal(got["w"].to_local(), want),
        got["step"],
    )


@pytest.mark.parametrize("staging", ["buffered", "direct"])
def test_a_save_holds_the_state_as_it_was_when_training_changes_it_right_after(staging):
    res = D.run(_save_then_train, 2, D.tmpdir(), staging)
    for first, second, err, staged, equal, step in res:
        assert first and second, err
        assert equal and step == 2
        assert staged == (64 * 32 * 4 if staging == "buffered" else 0)


def _stage_a_dtensor(rank, world):
    from torch.distributed.tensor import DTensor

    from ucp_dcp.memory.staging import Stager

    d = _state(rank, world, 1)["w"]
    got = Stager().stage({"w": d})["w"]
    return (
        isinstance(got, DTensor) and got.device_mesh is d.device_mesh and got.placements == d.placements,
        got.shape == d.shape and got.stride() == d.stride() and not got.requires_grad,
        torch.equal(got.to_local(), d.to_local()) and got.to_local().data_ptr() != d.to_local().data_ptr(),
    )


def test_a_staged_dtensor_keeps_its_mesh_placements_and_global_shape_over_a_buffer_of_its_own():
    for res in D.run(_stage_a_dtensor, 2):
        assert res == (True, True, True), res


def _staged_saves_without_control_groups(rank, world, root):
    from ucp_dcp.planning import checkpoint_group as cg

    D.setenv("UCP_DCP_HOST", f"node{rank}")
    with MemoryTier(root, replicas=1, control_group=False) as tier:
        for seed in (1, 2, 3):
            tier.save(_state(rank, world, seed), step=seed)
            status = tier.wait()
    shared = cg._GROUPS.get((0, 1))
    return status.complete, None if shared is None else shared[1].watch.calls


def test_with_control_groups_off_the_background_write_stays_off_the_shared_control_group():
    """MemoryTier(control_group=False): the staged saves' dcp.save runs on the tier's own gloo group, never
    on the checkpoint group DCP's foreground calls get (one sequence of ops per group)."""
    for complete, shared_ops in D.run(_staged_saves_without_control_groups, 2, D.tmpdir()):
        assert complete and not shared_ops, (complete, shared_ops)


def _save_while_the_last_one_replicates(rank, world, root):
    import os
    import time

    from ucp_dcp.memory import tier as tier_mod

    D.setenv("UCP_DCP_HOST", f"node{rank}")
    real = tier_mod.replicate
    go = os.path.join(root, f"go-{rank}")

    def slow_replicate(g, *a, **kw):  # generation 2's replication holds until the test lets it go
        if g.gen == 2:
            t0 = time.monotonic()
            while not os.path.exists(go) and time.monotonic() - t0 < 30:
                time.sleep(0.01)
        return real(g, *a, **kw)

    D.patch(tier_mod, "replicate", slow_replicate)
    with MemoryTier(root, replicas=1) as tier:
        tier.save(_state(rank, world, 1), step=1)
        tier.wait()
        tier.save(_state(rank, world, 2), step=2)
        sd = _state(rank, world, 3)
        t0 = time.monotonic()
        tier.save(sd, step=3)  # waits for generation 2's write into the store, not for its replication
        returned = time.monotonic() - t0
        in_flight = getattr(tier, "busy_steps", None)
        sd["w"].to_local().add_(1000.0)  # training goes on
        open(go, "w").close()
        tier.wait()
        statuses = [(s.gen, s.complete, repr(s.error)) for s in tier.statuses]
    got = {"w": torch.zeros_like(_state(rank, world, 3)["w"]), "step": -1}
    src = memory_load(got, root)
    equal = torch.equal(got["w"].to_local(), _state(rank, world, 3)["w"].to_local())
    return in_flight, returned, statuses, src.generation, equal, got["step"]


def test_a_staged_save_does_not_wait_for_the_last_generations_replication():
    """Two generations in flight: once generation 2's staged copy is written into the store, the save of
    generation 3 copies into the freed buffers and returns while generation 2 still replicates (held by
    the test); both complete in order and generation 3 loads bitwise as it was at its save."""
    for in_flight, returned, statuses, loaded, equal, step in D.run(_save_while_the_last_one_replicates, 2, D.tmpdir()):
        assert in_flight == [2, 3] and returned < 20, (in_flight, returned)
        assert statuses == [(1, True, "None"), (2, True, "None"), (3, True, "None")], statuses
        assert loaded == 3 and equal and step == 3
