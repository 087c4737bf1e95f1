"""A job saved on 2 gloo ranks to s3:// (moto's server on 127.0.0.1) resumes on 4 ranks at another layout,
bitwise, fetching exactly the bytes it needs from the store (counted at the server), where DCP's
FsspecReader fetches several times that; a tensor-parallel dim change (column slices of the saved rows)
loads bitwise with checksums verified, fetching the slices' bytes only in a few requests: the writer cut
each saved chunk into column bands (``storage/tiles.py``), so a slice is whole band chunks,
consecutive in the object. The pool's usual world sizes (2 and 4)."""

from __future__ import annotations

import uuid

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dev.testing.elastic import rank_stats

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

ROWS, COLS = 2048, 1024  # 8 MiB of fp32: 4 MiB per saved rank, 4 KiB rows: 4 column bands of 1 MiB each


def _full() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7))


def _env(env: dict) -> None:
    for k, v in env.items():
        D.setenv(k, v)


def _save_worker(rank, world, env, path, bands="store"):
    _env(env)
    mesh = DeviceMesh("cpu", torch.arange(world))
    w = distribute_tensor(_full(), mesh, [Shard(0)], src_data_rank=None)
    sd = {"w": w, "b": torch.arange(8.0), "step": 5}
    dcp.save(sd, storage_writer=UCPFileSystemWriter(path, column_bands=bands), planner=UCPSavePlanner())


def _load_worker(rank, world, env, path, dim, system, verify, ranges="few"):
    _env(env)
    mesh = DeviceMesh("cpu", torch.arange(world))
    tgt = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)], src_data_rank=None)
    sd = {"w": tgt, "b": torch.zeros(8), "step": -1}
    stats = None
    if system == "ucp":
        reader = UCPFileSystemReader(path, verify_checksums=verify, store_ranges=ranges)
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        stats = rank_stats(reader)
    else:  # DCP's own fsspec reader and default planner, on the same checkpoint (ours is DCP's format)
        from ucp_dcp._compat import fsspec_storage

        FsspecReader = fsspec_storage()[1]
        dcp.load(sd, storage_reader=FsspecReader(path))
    expect = distribute_tensor(_full(), mesh, [Shard(dim)], src_data_rank=None).to_local()
    ok = torch.equal(tgt.to_local(), expect) and torch.equal(sd["b"], torch.arange(8.0)) and sd["step"] == 5
    return ok, tgt.to_local().numel() * 4, stats


def _target(rank, world, dim=1):
    """The load's state dict for ``ucp_dcp plan`` (a function target: built under its fake process group)."""
    mesh = DeviceMesh("cpu", torch.arange(world))
    w = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(dim)], src_data_rank=None)
    return {"w": w, "b": torch.zeros(8), "step": -1}


@pytest.fixture(scope="module")
def _saved_once(s3_server):
    """One 2-rank save for the module's loads (each load only reads it)."""
    prefix = f"s3://{s3_server.bucket}/dist-{uuid.uuid4().hex[:8]}"
    D.run(_save_worker, 2, s3_server.env(), prefix, timeout=300)
    return prefix


@pytest.fixture
def saved(s3, _saved_once):
    """The server with its counters reset and ``prefix`` the saved checkpoint."""
    s3.faults.clear()
    s3.prefix = _saved_once
    return s3


@pytest.mark.quick
def test_a_2_rank_save_loads_on_4_ranks_fetching_only_the_needed_bytes(saved):
    res = D.run(_load_worker, 4, saved.env(), saved.prefix, 0, "ucp", False, timeout=300)
    assert all(ok for ok, _, _ in res)
    needed = sum(n for _, n, _ in res)
    fetched = saved.faults.bytes_out["GET data"]
    # the replicated "b" and the "step" object (bytes each rank reads whole) are the only bytes over "w"'s
    assert needed <= fetched <= 1.05 * needed, (fetched, needed)


def test_dcps_fsspec_reader_fetches_several_times_the_needed_bytes(saved):
    """The comparison the test above stands on: the same load through DCP's FsspecReader."""
    res = D.run(_load_worker, 4, saved.env(), saved.prefix, 0, "dcp", False, timeout=300)
    assert all(ok for ok, _, _ in res)
    assert saved.faults.bytes_out["GET data"] >= 1.5 * sum(n for _, n, _ in res)


def _chunks(prefix: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    md = UCPFileSystemReader(prefix).read_metadata()
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks]


def test_a_tp_dim_change_reads_only_the_slices_in_a_few_requests_by_default(saved):
    """The reader's defaults on the writer's default layout: each rank's column slice is one saved band chunk
    per saved rank, so it fetches the slice's bytes (<= 1.05x, counted at the server) in about one request per
    saved object, verified; ``ucp_dcp plan`` counts the same bytes and requests, rank by rank."""
    assert len(_chunks(saved.prefix)) == 8  # 2 saved chunks, each cut into 4 column bands of 1 MiB
    res = D.run(_load_worker, 4, saved.env(), saved.prefix, 1, "ucp", True, timeout=300)
    assert all(ok for ok, _, _ in res)
    needed = sum(n for _, n, _ in res)
    fetched = saved.faults.bytes_out["GET data"]
    assert needed <= fetched <= 1.05 * needed, (fetched, needed)
    assert all(st["reads"] <= 4 for _, _, st in res), [st["reads"] for _, _, st in res]
    from ucp_dcp.tools.dryrun import FunctionTarget, plan_load

    report = plan_load(saved.prefix, FunctionTarget(_target, 4, "dim 1"), device="cpu")
    assert [(r.bytes_read, r.reads) for r in report.ranks] == [(st["bytes_read"], st["reads"]) for _, _, st in res]


@pytest.mark.full
def test_a_tp_dim_change_loads_bitwise_with_checksums_verified_fetching_only_the_slices(saved):
    """``store_ranges="exact"`` on the band layout: the same slices, the same bytes."""
    res = D.run(_load_worker, 4, saved.env(), saved.prefix, 1, "ucp", True, "exact", timeout=300)
    assert all(ok for ok, _, _ in res)
    needed = sum(n for _, n, _ in res)
    fetched = saved.faults.bytes_out["GET data"]
    assert needed <= fetched <= 1.05 * needed, (fetched, needed)
    # ucp_dcp plan on the s3:// URL: every rank's bytes and requests are the load's (ReadStats)
    from ucp_dcp.tools.dryrun import FunctionTarget, plan_load

    report = plan_load(saved.prefix, FunctionTarget(_target, 4, "dim 1"), device="cpu", store_ranges="exact")
    assert report.loads, report.problems
    planned = [(r.bytes_read, r.reads) for r in report.ranks]
    assert planned == [(st["bytes_read"], st["reads"]) for _, _, st in res], planned


@pytest.mark.full
def test_a_checkpoint_saved_in_rows_still_loads_a_tp_dim_change(s3):
    """A checkpoint without column bands (``column_bands="off"``: an earlier ucp_dcp's, or a local folder
    copied to the store) loads the same slices bitwise, reading whole rows by default (4x: the bands are what
    bring it to 1.05x; ``store_ranges="exact"`` would fetch the slices only, at a request per saved row)."""
    prefix = f"s3://{s3.bucket}/rows-{uuid.uuid4().hex[:8]}"
    D.run(_save_worker, 2, s3.env(), prefix, "off", timeout=300)
    assert len(_chunks(prefix)) == 2
    s3.faults.clear()
    res = D.run(_load_worker, 4, s3.env(), prefix, 1, "ucp", True, timeout=300)
    assert all(ok for ok, _, _ in res)
    needed = sum(n for _, n, _ in res)
    assert s3.faults.bytes_out["GET data"] >= 3 * needed
