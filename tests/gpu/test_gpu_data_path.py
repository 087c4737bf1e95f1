"""GPU tier: saves and resharding loads of CUDA DTensors, bitwise against a ``torch.save`` oracle.

Several ranks share the one GPU on a gloo default group (gloo carries the host bytes; every state
tensor lives on the GPU), and a one-rank job runs on NCCL (and on ``cpu:gloo,cuda:nccl``), where
our host-byte exchanges need a gloo side group. Run with ``make test-gpu``.
"""

import os

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp._compat import group_has_cpu_backend
from ucp_dcp.planning.collectives import p2p_group

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHAPES = {"w1": (96, 64), "b1": (96,), "w2": (32, 96), "emb": (1000, 48)}


def _logical(salt: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + salt)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}


def _mesh(kind: str, world: int) -> tuple[DeviceMesh, list]:
    """A CUDA mesh and placements for one layout name."""
    if kind in ("dp", "tp_row"):
        return init_device_mesh("cuda", (world,)), [Shard(0)]
    if kind == "tp_col":
        return init_device_mesh("cuda", (world,)), [Shard(1)]
    if kind == "hsdp":
        return init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("rep", "shard")), [Replicate(), Shard(0)]
    if kind == "replicated":
        return init_device_mesh("cuda", (world,)), [Replicate()]
    raise ValueError(kind)


def _dtensors(
    values: dict[str, torch.Tensor], kind: str, world: int, empty: bool = False, dtype: torch.dtype | None = None
) -> dict[str, DTensor]:
    """DTensors of ``values`` at a layout, built from local pieces (no collectives)."""
    mesh, placements = _mesh(kind, world)
    out = {}
    for k, v in values.items():
        pl = [Shard(0) if isinstance(p, Shard) and v.dim() == 1 else p for p in placements]
        shape, offset = compute_local_shape_and_global_offset(v.shape, mesh, pl)
        piece = v[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local = torch.zeros(shape, dtype=dtype or v.dtype) if empty else piece.clone()
        out[k] = DTensor.from_local(local.cuda(), mesh, pl, run_check=False, shape=v.shape, stride=v.stride())
    return out


def _full_cpu(dt: DTensor) -> torch.Tensor:
    """The global value of a CUDA DTensor, gathered on CPU (gloo) so no CUDA collective is needed."""
    cpu_mesh = DeviceMesh("cpu", dt.device_mesh.mesh, mesh_dim_names=dt.device_mesh.mesh_dim_names)
    local = DTensor.from_local(
        dt.to_local().cpu(), cpu_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
    return local.full_tensor()


def _fsdp2_model(world: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).cuda()
    mesh = init_device_mesh("cuda", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _reshard_worker(rank, world, root, save_kind, load_kind, load_dtype):
    torch.cuda.set_device(0)  # every rank shares the one GPU
    oracle_path = os.path.join(root, "oracle.pt")
    if save_kind == "fsdp2":
        model = _fsdp2_model(world)
        state = model.state_dict()
        saved = {k: _full_cpu(v) for k, v in state.items()}
    else:
        saved = _logical(dtype=torch.bfloat16 if load_dtype == "widen" else torch.float32)
        state = _dtensors(saved, save_kind, world)
    if rank == 0:
        torch.save(saved, oracle_path)
    ucp_dcp.save(state, os.path.join(root, "ckpt"))
    dist.barrier()
    oracle = torch.load(oracle_path, weights_only=True)
    dtype = torch.float32 if load_dtype == "widen" else None
    target = _dtensors(oracle, load_kind, world, empty=True, dtype=dtype)
    reader = UCPFileSystemReader(os.path.join(root, "ckpt"))
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner(read_once="ranks"))
    torch.cuda.synchronize()
    bad = [k for k, v in target.items() if not torch.equal(_full_cpu(v), oracle[k].to(v.dtype))]
    assert all(v.device.type == "cuda" for v in target.values())
    return bad, reader.stats.staged_bytes, reader.stats.staging_buffers, reader.stats.bytes_received


CASES = [
    ("fsdp2", "tp_col", "same", "gloo"),  # FSDP2 (fully_shard) -> column-parallel TP
    ("tp_row", "hsdp", "same", "gloo"),  # TP -> HSDP (2 replicas x 2 shards): read-once between replicas
    ("hsdp", "dp", "same", "gloo"),
    ("dp", "replicated", "widen", "gloo"),  # bf16 saved, fp32 targets: converted on the device
    # torchtitan's kind of group: host bytes go to gloo (NCCL is never initialized, so ranks may share a GPU)
    ("tp_row", "hsdp", "same", "cpu:gloo,cuda:nccl"),
]


@pytest.mark.parametrize(
    "save_kind,load_kind,load_dtype,backend", CASES, ids=[f"{a}-to-{b}-{c}-{d}" for a, b, c, d in CASES]
)
def test_gpu_resharding_load_is_bitwise(save_kind, load_kind, load_dtype, backend):
    out = D.run(_reshard_worker, 4, D.tmpdir(), save_kind, load_kind, load_dtype, backend=backend)
    assert all(not bad for bad, *_ in out), out
    assert all(staged > 0 for _, staged, _, _ in out)  # the device path ran, through staging buffers
    assert all(0 < buffers <= 3 * 4 for _, _, buffers, _ in out)  # bounded: a few per reading thread


def _nccl_worker(rank, world, root):
    """One rank on NCCL (or cpu:gloo,cuda:nccl): sync save, async save, resharding-free load."""
    saved = _logical(1)
    state = _dtensors(saved, "dp", world)
    ucp_dcp.save(state, os.path.join(root, "sync"))
    path = os.path.join(root, "async")
    # dcp.async_save asserts a CPU backend in its group (torch 2.11-2.15): under plain NCCL, give it the gloo
    # side group ucp_dcp uses for host bytes anyway
    group = None if group_has_cpu_backend() else p2p_group()
    fut = dcp.async_save(state, storage_writer=UCPFileSystemWriter(path), planner=UCPSavePlanner(), process_group=group)
    for v in state.values():  # training goes on: the staged copy, not the live tensors, is saved
        v.to_local().add_(1.0)
    fut.result()
    results = {}
    for name in ("sync", "async"):
        target = _dtensors(saved, "replicated", world, empty=True)
        reader = UCPFileSystemReader(os.path.join(root, name))
        dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
        torch.cuda.synchronize()
        results[name] = [k for k, v in target.items() if not torch.equal(v.to_local().cpu(), saved[k])]
    group = p2p_group()
    side = None if group is None else dist.get_backend(group)
    return results, str(dist.get_backend()), side


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_gpu_one_rank_nccl_save_async_save_and_load(backend):
    ((results, got_backend, side),) = D.run(_nccl_worker, 1, D.tmpdir(), backend=backend)
    assert results == {"sync": [], "async": []}, results
    # host bytes need a gloo group: a side group under NCCL only, the default group when it has gloo
    assert side == ("gloo" if got_backend == "nccl" else None), (got_backend, side)


def test_gpu_memory_staging_copies_device_tensors_into_pinned_buffers_kept_between_saves():
    """The memory tier's staged copy of CUDA state: pinned host buffers, equal bytes, the same buffers on
    the next save, a DTensor's CUDA mesh kept over its host buffer (one process)."""
    from ucp_dcp.memory.staging import Stager

    t = torch.randn(256, 64, device="cuda")
    st = Stager()
    got = st.stage({"t": t, "tied": t})
    assert got["t"].device.type == "cpu" and got["t"].is_pinned() and got["tied"] is got["t"]
    assert torch.equal(got["t"], t.cpu())
    ptr = got["t"].data_ptr()
    t.add_(1.0)
    again = st.stage({"t": t, "tied": t})
    assert again["t"].data_ptr() == ptr and torch.equal(again["t"], t.cpu())
