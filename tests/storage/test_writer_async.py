"""``dcp.async_save`` with ucp_dcp's planner and writer (issue 10), on 2 gloo ranks.

A small FSDP2 model (``fully_shard`` on a dp=2 mesh, uneven shards) and its AdamW state after one
step are saved with ``dcp.async_save(..., storage_writer=UCPFileSystemWriter(path),
planner=UCPSavePlanner())``, by a thread (``AsyncCheckpointerType.THREAD``, DCP's default) or by
DCP's checkpoint daemon process (``.PROCESS``). Each test is one spawn:

* the save commits (``.metadata`` plus its ``.ucp.*.json`` sidecar, ``verify`` passes) and loads
  bitwise at another layout (``Shard(1)``, replicated, one rank with plain tensors);
* a save over an existing checkpoint leaves that one intact and verifiable while it is in flight;
* training that goes on right after ``async_save`` returns (an optimizer step that changes the
  live parameters and moments in place) does not change what is saved: the writer is held until
  the step is done, so a stager that did not copy would save the new values (the last test shows
  the check catches exactly that).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ucp_dcp
from ucp_dcp import UCPFileSystemWriter, UCPSavePlanner
from ucp_dcp.tools.verify import verify

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WORLD = 2
GATE_TIMEOUT_S = 60.0


# -- worker-side helpers ------------------------------------------------------------------------------


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _job(rank: int):
    """FSDP2 model (10x12 and 7x10 weights: even and uneven row shards) + AdamW after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 7))
    mesh = DeviceMesh("cpu", torch.arange(WORLD), mesh_dim_names=("dp",))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, seed=rank)
    return model, opt, mesh


def _state(model, opt) -> dict:
    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o, "train": {"step": 1}}


def _map(x, fn):
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    if isinstance(x, list):
        return [_map(v, fn) for v in x]
    if isinstance(x, tuple):
        return tuple(_map(v, fn) for v in x)
    return fn(x)


def _logical(sd: dict) -> dict:
    """Every value as the global (unsharded) tensor or a copy of the object. Collective."""
    return _map(
        sd,
        lambda v: (
            v.full_tensor()
            if isinstance(v, DTensor)
            else v.detach().clone()
            if isinstance(v, torch.Tensor)
            else copy.deepcopy(v)
        ),
    )


def _diff(a, b, path: str = "") -> list[str]:
    """Paths where ``a`` and ``b`` differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path + " (keys)"]
        return [p for k in a for p in _diff(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path + " (length)"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _diff(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


def _target(sd: dict, layout: str, mesh: DeviceMesh) -> dict:
    """An empty state shaped like ``sd`` at another layout: sharded tensors become zeros at
    ``Shard(1)`` (``Shard(0)`` for vectors), replicated, or plain full tensors (``one_rank``);
    objects become None so they must come from the checkpoint."""

    def empty(v):
        if isinstance(v, DTensor):
            z = torch.zeros(v.shape, dtype=v.dtype)
            if layout == "one_rank":
                return z
            placement = Replicate() if layout == "replicate" else Shard(1 if v.dim() >= 2 else 0)
            return distribute_tensor(z, mesh, [placement], src_data_rank=None)
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        return v

    out = _map(sd, empty)
    out["train"] = {"step": None}
    return out


def _load_at(sd: dict, path: str, layout: str, mesh: DeviceMesh, rank: int) -> dict | None:
    """Load ``path`` into ``sd``'s shape at ``layout``; the loaded logical state (on the ranks that
    loaded). Collective over the world (the one-rank group must be created by every rank)."""
    one = dist.new_group([0])
    if layout == "one_rank" and rank != 0:
        return None
    target = _target(sd, layout, mesh)
    ucp_dcp.load(target, path, process_group=one if layout == "one_rank" else None)
    return _logical(target)


def _sidecars_of(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.startswith(".ucp.") and n.endswith(".json"))


def _sidecars(path: str) -> list[str]:
    return _sidecars_of(os.listdir(path))


def _committed(path: str) -> tuple[str, list[str]]:
    """(verify status, sidecar names) of the checkpoint in ``path``."""
    return verify(path).status, _sidecars(path)


class _GatedWriter(UCPFileSystemWriter):
    """``UCPFileSystemWriter`` that starts writing only once the file ``gate`` exists, so the test
    decides what the live tensors hold while the bytes are written. Picklable (PROCESS mode)."""

    def __init__(self, path, gate: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.gate = gate

    def write_data(self, plan, planner):
        Path(self.gate + ".reached").touch()  # planned, about to write
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} never opened")
            time.sleep(0.002)
        return super().write_data(plan, planner)


class _GatedPlanner(UCPSavePlanner):
    """``UCPSavePlanner`` that plans only once the file ``gate`` exists: the step a test trains after
    ``async_save`` returns is then over on every rank before any rank plans (without it, ranks digest
    their replicas on either side of the step and a non-copying stager's save is refused for the race
    instead). Picklable (PROCESS mode)."""

    def __init__(self, gate: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def __reduce__(self):
        return (_GatedPlanner, (self.gate,))

    def set_up_planner(self, *args, **kwargs):
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} never opened")
            time.sleep(0.002)
        return super().set_up_planner(*args, **kwargs)


class _NoCopyStager(AsyncStager):
    """A broken stager that hands the live state over instead of a copy (the negative control)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _open(gate: str) -> None:
    Path(gate).touch()


def _wait_reached(gate: str) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(gate + ".reached"):
        assert time.monotonic() < deadline, "the save never reached write_data"
        time.sleep(0.002)


# -- workers ------------------------------------------------------------------------------------------


def _roundtrip_worker(rank, world, root, kind: str, layout: str):
    """async_save -> committed + verified -> load at ``layout`` -> compare bitwise."""
    model, opt, mesh = _job(rank)
    sd = _state(model, opt)
    saved = _logical(sd)
    path = f"{root}/ckpt"
    t0 = time.perf_counter()
    fut = dcp.async_save(
        sd,
        checkpoint_id=path,
        storage_writer=UCPFileSystemWriter(path),
        planner=UCPSavePlanner(),
        async_checkpointer_type=AsyncCheckpointerType[kind],
    )
    blocked = time.perf_counter() - t0
    md = fut.result(timeout=120)
    assert isinstance(md, Metadata), type(md)
    dist.barrier()
    status = _committed(path) if rank == 0 else None
    dist.barrier()
    loaded = _load_at(sd, path, layout, mesh, rank)
    return {
        "blocked": blocked,
        "status": status,
        "diff": None if loaded is None else _diff(saved, loaded),
        "n_tensors": sum(isinstance(v, DTensor) for v in sd["model"].values()),
    }


def _over_worker(rank, world, root):
    """An async save over a committed checkpoint: while its writes are held back, the folder still
    holds the old checkpoint, verified; after the future, the new one, and the old files are gone."""
    model, opt, mesh = _job(rank)
    path, gate = f"{root}/ckpt", f"{root}/gate{rank}"
    ucp_dcp.save(_state(model, opt), path)
    old = _logical(_state(model, opt))
    old_files = sorted(os.listdir(path))
    _train_step(model, opt, seed=10 + rank)
    sd = _state(model, opt)
    new = _logical(sd)
    writer = _GatedWriter(path, gate)
    fut = dcp.async_save(
        sd,
        checkpoint_id=path,
        storage_writer=writer,
        planner=UCPSavePlanner(),
        process_group=dist.new_group(backend="gloo"),
    )
    _wait_reached(gate)  # planned on every rank, nothing written yet
    dist.barrier()
    during = (_committed(path), sorted(os.listdir(path))) if rank == 0 else None
    _open(gate)
    fut.result(timeout=120)
    dist.barrier()
    after = (_committed(path), sorted(os.listdir(path))) if rank == 0 else None
    dist.barrier()
    loaded = _load_at(sd, path, "replicate", mesh, rank)
    return {
        "old_files": old_files,
        "during": during,
        "after": after,
        "removed": sorted(writer.removed),
        "new_vs_old": _diff(new, old),
        "diff": _diff(new, loaded),
    }


def _mutation_worker(rank, world, root, kind: str, stager: str):
    """Train one more step right after async_save returns, before any byte is written."""
    model, opt, mesh = _job(rank)
    sd = _state(model, opt)
    before = _logical(sd)
    path, gate = f"{root}/ckpt", f"{root}/gate{rank}"
    fut = dcp.async_save(
        sd,
        checkpoint_id=path,
        storage_writer=_GatedWriter(path, gate),
        planner=_GatedPlanner(f"{gate}.plan"),
        async_checkpointer_type=AsyncCheckpointerType[kind],
        async_stager=_NoCopyStager() if stager == "none" else None,
        # training collectives go on on the default group meanwhile
        process_group=dist.new_group(backend="gloo"),
    )
    _train_step(model, opt, seed=100 + rank)  # in place: parameters, moments, step counters
    after = _logical(sd)  # also proves the state dict aliases the live tensors
    dist.barrier()  # every rank has stepped: now plan (digests), then write
    _open(f"{gate}.plan")
    _open(gate)
    fut.result(timeout=120)
    dist.barrier()
    status = _committed(path) if rank == 0 else None
    dist.barrier()
    loaded = _load_at(sd, path, "shard1", mesh, rank)
    return {
        "changed": _diff(before, after),
        "vs_before": _diff(before, loaded),
        "vs_after": _diff(after, loaded),
        "status": status,
    }


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,layout",
    [
        ("THREAD", "shard1"),
        ("THREAD", "replicate"),
        ("THREAD", "one_rank"),
        # make test keeps DCP's checkpoint process in the mutation test below and in test_async_api.py
        pytest.param("PROCESS", "shard1", marks=pytest.mark.full),
    ],
)
def test_async_save_commits_verifies_and_loads_bitwise_at_another_layout(kind, layout):
    res = D.run(_roundtrip_worker, WORLD, D.tmpdir(), kind, layout, timeout=180)
    status, sidecars = res[0]["status"]
    assert status == "ok" and len(sidecars) == 1, (status, sidecars)
    assert res[0]["n_tensors"] == 4
    for r in res:
        if r["diff"] is not None:
            assert r["diff"] == [], f"{kind} {layout}: loaded values differ from the saved ones at {r['diff']}"
    assert sum(r["diff"] is not None for r in res) == (1 if layout == "one_rank" else WORLD)


def test_async_save_over_a_checkpoint_keeps_it_until_the_commit():
    r = D.run(_over_worker, WORLD, D.tmpdir(), timeout=180)
    (status, sidecars), files = r[0]["during"]
    assert status == "ok" and sidecars == _sidecars_of(r[0]["old_files"]), (status, sidecars)
    assert set(r[0]["old_files"]) <= set(files), "the old checkpoint's files must stay until the commit"
    (status2, sidecars2), files2 = r[0]["after"]
    assert status2 == "ok" and len(sidecars2) == 1 and sidecars2 != sidecars, (status2, sidecars2)
    assert not set(r[0]["old_files"]) & set(files2) - {".metadata"}, "the replaced files are removed after the commit"
    assert set(r[0]["removed"]) == set(r[0]["old_files"]) - {".metadata"}
    assert r[0]["new_vs_old"], "the second save must hold other values than the first"
    for x in r:
        assert x["diff"] == [], x["diff"]


@pytest.mark.parametrize("kind", ["THREAD", "PROCESS"])
def test_training_right_after_async_save_returns_does_not_change_the_checkpoint(kind):
    res = D.run(_mutation_worker, WORLD, D.tmpdir(), kind, "default", timeout=180)
    assert res[0]["status"][0] == "ok" and len(res[0]["status"][1]) == 1, res[0]["status"]
    for r in res:
        # the step changed the live tensors the state dict holds (else the check proves nothing)
        assert any("/model/" in p for p in r["changed"]) and any("exp_avg" in p for p in r["changed"]), r["changed"]
        assert r["vs_before"] == [], f"{kind}: saved values are not the ones at async_save: {r['vs_before']}"


def test_the_mutation_check_catches_a_stager_that_does_not_copy():
    res = D.run(_mutation_worker, WORLD, D.tmpdir(), "THREAD", "none", timeout=180)
    assert res[0]["status"][0] == "ok" and len(res[0]["status"][1]) == 1, res[0]["status"]  # ucp_dcp committed it
    for r in res:
        assert r["changed"] and r["vs_before"], "without a copy the checkpoint must hold the post-step values"
        assert r["vs_after"] == [], r["vs_after"]
