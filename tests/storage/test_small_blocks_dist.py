"""Verified resharding loads of small chunks read about the bytes they need (issue 47), on gloo ranks.

An FSDP2-like state (parameters and two Adam moments, ``Shard(0)``, fp32) saved on 2 ranks in chunks of
about 64 KiB — dims that do not split evenly, so the 4-rank load cuts chunks off their block edges — loads on
4 ranks bitwise with checksums verified, reading at most 1.05x the bytes the ranks need (with one 1 MiB
block per chunk every rank read each chunk it touches whole: 2.4x here); ``ucp_dcp plan`` predicts every
rank's bytes, reads and items exactly; and a flipped byte inside one 1 KiB block is a ``ChecksumError``
naming that block. The block rule itself: ``tests/storage/test_block_sizes.py``.
"""

from __future__ import annotations

import os
import shutil

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.storage.format import IO_KEY

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

SHAPES = {
    "layers.0.attn.w": (250, 131),  # 125 rows of 524 B a saved chunk (64 KiB): 1 KiB blocks; cut at rows 63, 1, 64
    "layers.0.mlp.w": (256, 128),  # 64 KiB chunks, cut on a block edge
    "layers.0.norm": (32771,),  # 64 KiB chunks of an odd length
    "embed": (1021, 257),  # 513 KiB chunks: 8 KiB blocks
}
MOMENTS = ("", "exp_avg.", "exp_avg_sq.")  # FSDP2's optimizer state: a sharded moment of each kind per param


def _shape(name: str) -> tuple[int, ...]:
    return SHAPES[name.split(".", 1)[1] if name.startswith("exp_avg") else name]


def _state(world: int, fill: bool, group: dist.ProcessGroup | None = None) -> dict:
    # a mesh over a subset of the ranks comes from that subset's group: DeviceMesh("cpu", ranks) would call
    # new_group on the subset's ranks only, which every rank of the job must call
    mesh = DeviceMesh.from_group(group, "cpu") if group is not None else DeviceMesh("cpu", torch.arange(world))
    out = {}
    for param in SHAPES:
        for moment in MOMENTS:
            name = moment + param
            g = torch.Generator().manual_seed(sum(map(ord, name)))
            full = torch.randn(_shape(name), generator=g) if fill else torch.zeros(_shape(name))
            out[name] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    return out


def _target(rank: int, world: int) -> dict:
    """The load's state dict, for ``ucp_dcp plan`` (a function target: built under its fake process group)."""
    return _state(world, fill=False)


def _stats(reader: UCPFileSystemReader) -> dict:
    s = reader.stats
    return {
        "bytes_read": s.bytes_read,
        "reads": s.ranges,
        "items": sorted(set(s.items)),
        "bytes_received": s.bytes_received,
        "fallbacks": s.fallbacks,
    }


def _flip(path: str, fqn: str, offsets: tuple[int, ...], at: int) -> None:
    md = dcp.FileSystemReader(path).read_metadata()
    info = md.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
    entry = md.storage_data[MetadataIndex(IO_KEY)]["items"][f"{fqn}|{','.join(map(str, offsets))}"]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + entry[0] + at)
        b = f.read(1)
        f.seek(info.offset + entry[0] + at)
        f.write(bytes([b[0] ^ 4]))


def _worker(rank, world, root):
    """Save on ranks 0-1, load on 0-3 verified; keep a copy of the checkpoint for the plan, flip a byte and
    load again. Returns this rank's (bitwise, ReadStats figures, bytes needed, error of the damaged load)."""
    path = f"{root}/ckpt"
    pair = dist.new_group([0, 1])
    if rank < 2:
        dcp.save(
            _state(2, True, pair),
            storage_writer=UCPFileSystemWriter(path),
            planner=UCPSavePlanner(),
            process_group=pair,
        )
    dist.barrier()
    tgt = _state(world, fill=False)
    reader = UCPFileSystemReader(path)  # verify_checksums=True, the default
    dcp.load(tgt, storage_reader=reader, planner=UCPLoadPlanner())
    expect = _state(world, fill=True)
    ok = all(torch.equal(tgt[n].to_local(), expect[n].to_local()) for n in tgt)
    needed = sum(t.to_local().nbytes for t in tgt.values())
    dist.barrier()
    if rank == 0:
        shutil.copytree(path, f"{root}/clean")
        # byte 5 of block 37 of the second saved chunk of attn.w (its rows 125..249): rank 2 reads it (126..188)
        _flip(path, "layers.0.attn.w", (125, 0), 37 * 1024 + 5)
    dist.barrier()
    try:
        dcp.load(_state(world, fill=False), storage_reader=UCPFileSystemReader(path), planner=UCPLoadPlanner())
        error = None
    except CheckpointException as e:
        error = str(ucp_dcp.first_ucp_error(e))
    return ok, _stats(reader), needed, error


def test_a_verified_2_to_4_load_of_64_kib_chunks_reads_at_most_1_05x_and_plan_predicts_it():
    from ucp_dcp.tools.dryrun import FunctionTarget, plan_load

    folder = D.tmpdir()
    res = D.run(_worker, 4, folder, timeout=300)
    assert all(ok for ok, *_ in res), "not bitwise"
    stats = [st for _, st, _, _ in res]
    read, needed = sum(st["bytes_read"] for st in stats), sum(n for _, _, n, _ in res)
    assert all(st["fallbacks"] == 0 and st["bytes_received"] == 0 for st in stats), stats
    assert needed <= read <= 1.05 * needed, (read, needed, read / needed)
    # ucp_dcp plan of the same load (before the damage): every rank's bytes, reads and items, exactly
    report = plan_load(f"{folder}/clean", FunctionTarget(_target, 4, "fsdp2 at 4"), device="cpu", keep_items=True)
    assert report.loads, report.problems
    planned = [
        {
            "bytes_read": r.bytes_read,
            "reads": r.reads,
            "items": sorted(r.items or []),
            "bytes_received": r.bytes_received,
            "fallbacks": r.fallbacks,
        }
        for r in report.ranks
    ]
    assert planned == stats
    # the damaged byte: found by its 1 KiB block, whichever rank reports first
    errors = [e for *_, e in res]
    assert all(e is not None for e in errors), errors
    assert any("'layers.0.attn.w' chunk at [125, 0]: block 37 (bytes 37888.." in e for e in errors), errors
