"""Structural facts checked instead of trusted declarations (issue 21): whole tensors from different
meshes are not replicas (a forgotten stage_map / expert_map at save or at load), replicated DTensor
pieces must agree, a padding rule must not drop data, and target keys must not alias."""

import os

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_written_by_ucp, ucp_failure
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ucp_dcp
from ucp_dcp import UCPSavePlanner
from ucp_dev.toy import ModelConfig, Topology, build_job, build_trainer, train_step, trainer_options

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _failure(fn):
    """(error class name, atom, message) of the UCPError ``fn`` raised, or None if it returned."""
    try:
        fn()
    except CheckpointException as e:
        err = ucp_failure(e)
        return type(err).__name__, err.atom, str(err)
    except ucp_dcp.UCPError as err:
        return type(err).__name__, err.atom, str(err)
    return None


def _toy(topo: str, seed: int):
    cfg = ModelConfig()
    job = build_job(Topology.parse(topo), list(range(Topology.parse(topo).world)))
    tr = build_trainer(cfg, job, seed=seed)
    return cfg, job, tr


def _stage_map_dropped_at_save_worker(rank, world, root):
    cfg, job, tr = _toy("dp=2,pp=2", 0)
    train_step(tr)
    opts = trainer_options(cfg, tr)
    opts.pop("stage_map")
    out = _failure(
        lambda: dcp.save(
            tr.state_dict(),
            storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/ckpt"),
            process_group=job.group,
            planner=UCPSavePlanner(**opts),
        )
    )
    return out, os.path.exists(f"{root}/ckpt/.metadata")


@pytest.mark.slow
def test_stage_local_names_without_a_stage_map_are_refused_at_save():
    (out, written) = D.run(_stage_map_dropped_at_save_worker, 4, D.tmpdir())[0]
    assert out is not None, "a pp=2 save with stage-local names and no stage_map went through"
    name, atom, text = out
    assert name == "AmbiguousLayoutError" and "layers.0" in atom and "stage_map" in text, out
    assert "ranks [0, 1] (pp=0) and [2, 3] (pp=1)" in text, text
    assert not written


def _stage_map_dropped_at_load_worker(rank, world, root):
    cfg, job, tr = _toy("dp=2,pp=2", 0)
    train_step(tr)
    ucp_dcp.save(tr.state_dict(), f"{root}/ckpt", process_group=job.group, **trainer_options(cfg, tr))
    cfg, job, tr = _toy("dp=2,pp=2", 1)
    opts = trainer_options(cfg, tr)
    opts.pop("stage_map")
    return _failure(lambda: ucp_dcp.load(tr.state_dict(), f"{root}/ckpt", process_group=job.group, **opts))


@pytest.mark.slow
def test_a_stage_map_forgotten_at_load_is_refused():
    out = D.run(_stage_map_dropped_at_load_worker, 4, D.tmpdir())[0]
    assert out is not None, "a pp=2 load with stage-local names and no stage_map went through"
    name, atom, text = out
    # the toy's stage chunks are namespaced (model.c0): without the map its names are not the saved ones
    assert name == "MissingAtomsError" and "model.c0" in atom, out
    assert "saved with index map(s) ['layers'] (stage_map) and this load passes none" in text, text


def _two_meshes_worker(rank, world, root):
    """The guide's situation without the toy: each 'stage' shards its own layers.0 over its own mesh."""
    meshes = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]  # every rank creates both groups, in order
    mine = meshes[rank // 2]
    torch.manual_seed(rank // 2)  # each stage its own values
    w = distribute_tensor(torch.randn(4, 3), mine, [Shard(0)], src_data_rank=None)
    return _failure(
        lambda: dcp.save(
            {"layers.0.w": w}, storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/c"), planner=UCPSavePlanner()
        )
    )


@pytest.mark.slow
def test_dtensors_of_one_name_on_two_meshes_are_not_replicas():
    out = D.run(_two_meshes_worker, 4, D.tmpdir())[0]
    assert out is not None and out[0] == "AmbiguousLayoutError" and out[1] == "layers.0.w", out
    assert "stage_map" in out[2] and "[0, 1] and [2, 3]" in out[2], out[2]


def _replica_dtensor_worker(rank, world, root, check):
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dpr", "dp"))
    local = torch.arange(6.0).reshape(3, 2) + 6.0 * (rank % 2) + (100.0 if rank == 3 else 0.0)  # rank 3 drifted
    w = ucp_dcp._compat.dtensor_from_local(local, mesh, [Replicate(), Shard(0)], torch.Size((6, 2)), (2, 1))
    if check == "writer":  # ucp_dcp.save: compared after the write, from the writer's block checksums
        out = _failure(lambda: ucp_dcp.save({"w": w}, f"{root}/r"))
        return out and out + (os.path.exists(f"{root}/r/.metadata"),)
    kw = {} if check is None else {"check_replicas": check}
    return _failure(
        lambda: dcp.save(
            {"w": w}, storage_writer=ucp_dcp.UCPFileSystemWriter(f"{root}/r"), planner=UCPSavePlanner(**kw)
        )
    )


@pytest.mark.slow
def test_replicated_dtensor_copies_that_differ_are_refused_by_default():
    out = D.run(_replica_dtensor_worker, 4, D.tmpdir(), None)[0]
    assert out is not None and out[0] == "ReplicaMismatchError" and out[1] == "w", out
    assert "ranks [1]" in out[2] and "ranks [3]" in out[2], out[2]


@pytest.mark.slow
def test_replicated_copies_that_differ_are_refused_from_the_writers_checksums():
    out = D.run(_replica_dtensor_worker, 4, D.tmpdir(), "writer")[0]
    assert out is not None and out[0] == "ReplicaMismatchError" and out[1] == "w", out
    assert "rank 3's copy differs" in out[2] and out[3] is False, out  # nothing committed


@pytest.mark.slow
def test_the_replica_check_can_be_turned_off():
    root = D.tmpdir()
    assert D.run(_replica_dtensor_worker, 4, root, "off")[0] is None
    assert_written_by_ucp(f"{root}/r")  # saved by ucp_dcp with its check off (stock DCP has none to turn off)


def _two_meshes_load_worker(rank, world_size, root):
    """Saved with global layer names; loaded by two 'stages' that each call their first layer layers.0
    on their own mesh and pass no stage_map."""
    full = DeviceMesh("cpu", torch.arange(4))
    torch.manual_seed(0)
    sd = {f"layers.{i}.w": distribute_tensor(torch.randn(4, 3), full, [Shard(0)]) for i in range(2)}
    ucp_dcp.save(sd, f"{root}/g")
    world = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("pp", "dp"))
    target = {"layers.0.w": distribute_tensor(torch.zeros(4, 3), world["dp"], [Shard(0)], src_data_rank=None)}
    return _failure(lambda: ucp_dcp.load(target, f"{root}/g"))


@pytest.mark.slow
def test_one_name_wanted_whole_on_two_meshes_is_refused_at_load():
    out = D.run(_two_meshes_load_worker, 4, D.tmpdir())[0]
    assert out is not None and out[0] == "AmbiguousLayoutError" and out[1] == "layers.0.w", out
    assert "at load" in out[2] and "stage_map" in out[2], out[2]


def _tp_only_replicas_worker(rank, world_size, root):
    """DDP x TP: each data-parallel rank holds a whole copy on its own TP mesh. Those are replicas:
    saved once and loaded into every copy, at save compared (equal here)."""
    world = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    w = distribute_tensor(torch.randn(4, 3), world["tp"], [Shard(0)])
    ucp_dcp.save({"w": w}, f"{root}/tp")
    target = {"w": distribute_tensor(torch.zeros(4, 3), world["tp"], [Shard(1)])}
    stats = ucp_dcp.load(target, f"{root}/tp")
    # each rank's piece came through UCPFileSystemReader: read from the file or received from a peer
    return torch.equal(target["w"].full_tensor(), w.full_tensor()) and stats.bytes_read + stats.bytes_received > 0


@pytest.mark.slow
def test_tp_meshes_of_data_parallel_ranks_hold_replicas():
    root = D.tmpdir()
    assert D.run(_tp_only_replicas_worker, 4, root) == [True] * 4
    assert_written_by_ucp(f"{root}/tp")
