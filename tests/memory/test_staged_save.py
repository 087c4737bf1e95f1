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
    from ucp_dcp.planning import control_group as cg

    D.setenv("UCP_DCP_HOST", f"node{rank}")
    with MemoryTier(root, replicas=1, control_group=False) as tier:
        for seed in (1, 2, 3):
            tier.save(_state(rank, world, seed), step=seed)
            status = tier.wait()
    shared = cg._GROUPS.get((0, 1))
    return status.complete, None if shared is None else shared[1].seq


def test_with_control_groups_off_the_background_write_stays_off_the_shared_control_group():
    """MemoryTier(control_group=False): the staged saves' dcp.save runs on the tier's own gloo group, never
    on the control group DCP's foreground calls get (one sequence of ops per group)."""
    for complete, shared_ops in D.run(_staged_saves_without_control_groups, 2, D.tmpdir()):
        assert complete and not shared_ops, (complete, shared_ops)
