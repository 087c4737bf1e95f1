"""``ucp_dcp.async_save`` (issue 34): ``dcp.async_save``'s semantics with ucp_dcp's planner and storage.

Saved on 2 gloo ranks (a DTensor sharded over them, plus a plain counter), loaded at 1 rank bitwise; the
stager form's state may change once staging is complete; a failure comes out of ``result()`` as the
``UCPError`` itself. DCP's process-based form (its checkpoint process) is one more case.
"""

import dist as D
import pytest
import torch
import torch.distributed as dist
from helpers import assert_written_by_ucp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ucp_dcp

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

FULL = torch.arange(48.0).reshape(8, 6)


def _state(world):
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), "step": torch.tensor(7)}


def _save_worker(rank, world, root, how):
    group = dist.new_group(backend="gloo")  # the background save's collectives apart from the main thread's
    sd = _state(world)
    if how == "stager":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, True, False))  # asynchronous staging
        try:
            resp = ucp_dcp.async_save(sd, root, process_group=group, async_stager=stager)
            resp.staging_completion.result()
            sd["w"].to_local().add_(1000.0)  # after staging: the checkpoint keeps the values at the call
            resp.upload_completion.result()
        finally:
            stager.close()
        return "ok"
    fut = ucp_dcp.async_save(sd, root, process_group=group, async_checkpointer_type=how)
    fut.result()
    return "ok"


def _load_worker(rank, world, root):
    target = {"w": torch.zeros(8, 6), "step": torch.tensor(0)}
    ucp_dcp.load(target, root)
    return torch.equal(target["w"], FULL) and int(target["step"]) == 7


@pytest.mark.parametrize("how", ["thread", "stager"])
def test_async_save_on_two_ranks_loads_bitwise_at_one(how):
    root = D.tmpdir()
    assert D.run(_save_worker, 2, root, how) == ["ok", "ok"]
    assert_written_by_ucp(root)
    assert D.run(_load_worker, 1, root) == [True]


def test_async_save_in_dcps_checkpoint_process_loads_bitwise():
    root = D.tmpdir()
    assert D.run(_save_worker, 2, root, "process") == ["ok", "ok"]
    assert_written_by_ucp(root)
    assert D.run(_load_worker, 1, root) == [True]


def _mismatch_worker(rank, world, root):
    group = dist.new_group(backend="gloo")
    fut = ucp_dcp.async_save({"b": torch.full((3,), float(rank))}, root, process_group=group)
    try:
        fut.result()
    except ucp_dcp.UCPError as e:
        return type(e).__name__
    except BaseException as e:  # DCP's CheckpointException: what a bare dcp.async_save's future raises
        return f"not a UCPError: {type(e).__name__}"
    return "saved"


def test_a_failed_async_save_raises_the_ucp_error_from_result():
    out = D.run(_mismatch_worker, 2, D.tmpdir())
    assert all(o.endswith("ReplicaMismatchError") for o in out), out


def test_an_unknown_checkpointer_kind_is_refused_before_any_work():
    with pytest.raises(ucp_dcp.InvalidArgumentError, match="async_checkpointer_type"):
        ucp_dcp.async_save({"w": torch.zeros(1)}, D.tmpdir(), async_checkpointer_type="fork")
