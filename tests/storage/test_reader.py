"""Ranged reads, checksums and read-once transport: correctness (bitwise), not speed."""

import io
import os
import zipfile

import dist as D
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import expect_ucp_error, rewrite_metadata
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import ucp_dcp
from ucp_dcp import TruncatedFileError, UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.storage.format import (
    IO_KEY,
    TABLE_HASH,
    box_grid,
    box_runs,
    gather_grid,
    merge_intervals,
    parse_tensor_record,
    split_grid,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.data())
def test_box_runs_are_the_box_bytes_in_order(shape, data):
    t = torch.arange(int(np.prod(shape)) if shape else 1, dtype=torch.int32).reshape(shape)
    offs = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offs)]
    starts, run = box_runs(shape, 4, offs, sizes)
    raw = t.numpy().tobytes()
    got = b"".join(raw[s : s + run] for s in starts.tolist())
    box = t[tuple(slice(o, o + n) for o, n in zip(offs, sizes))] if shape else t
    assert got == box.contiguous().numpy().tobytes()


@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.data())
def test_grid_gather_and_split_equal_the_box(shape, data):
    t = torch.arange(int(np.prod(shape)) if shape else 1, dtype=torch.int32).reshape(shape)
    offs = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offs)]
    box = (t[tuple(slice(o, o + n) for o, n in zip(offs, sizes))] if shape else t).contiguous().numpy().tobytes()
    g = box_grid(shape, 4, offs, sizes)
    assert g.nbytes == len(box)
    src = np.frombuffer(t.numpy().tobytes(), dtype=np.uint8)
    # from a window that starts exactly where the grid does, and from the whole chunk
    for lo in (g.first, 0):
        out = np.empty(g.nbytes, dtype=np.uint8)
        gather_grid(src[lo : g.end], lo, g, out)
        assert out.tobytes() == box
    limit = data.draw(st.integers(1, max(1, g.end - g.first)))
    pieces = split_grid(g, limit)
    assert all(p.end - p.first <= max(limit, 0) or (not p.counts and p.run <= limit) for p in pieces)
    out = np.concatenate(
        [np.empty(0, dtype=np.uint8)]
        + [(lambda o: (gather_grid(src, 0, p, o), o)[1])(np.empty(p.nbytes, dtype=np.uint8)) for p in pieces]
    )
    assert out.tobytes() == box
    with pytest.raises(TruncatedFileError):  # never reads outside the window it is given
        gather_grid(src[g.first : g.end - 1], g.first, g, np.empty(g.nbytes, dtype=np.uint8))


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=30))
def test_merge_intervals_is_the_union(iv):
    starts = np.array([a for a, _ in iv], dtype=np.int64)
    lens = np.array([n for _, n in iv], dtype=np.int64)
    merged = merge_intervals(starts, lens)
    covered = {x for a, n in iv for x in range(a, a + n)}
    assert {x for a, n in merged for x in range(a, a + n)} == covered
    ends = [a + n for a, n in merged]
    assert all(ends[i] < merged[i + 1][0] for i in range(len(merged) - 1))  # disjoint, non-touching, sorted


@given(st.integers(1, 6), st.data())
def test_assign_readers_reads_every_shared_piece_once_and_orders_messages(n, data):
    from ucp_dcp.storage.transport import assign_readers

    universe = data.draw(st.integers(1, 12))
    size_of = [data.draw(st.integers(0, 40)) for _ in range(universe)]
    held = [data.draw(st.lists(st.integers(0, universe - 1), max_size=8)) for _ in range(n)]  # repeats allowed
    keys = [np.array([[k, 7] for k in h], dtype=np.uint64).reshape(-1, 2) for h in held]
    sizes = [np.array([size_of[k] for k in h], dtype=np.int64) for h in held]
    bundle = data.draw(st.sampled_from([1, 50, 1 << 20]))
    solo = data.draw(st.sampled_from([1, 20, 1 << 20]))
    hosts = (
        np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))) if data.draw(st.booleans()) else None
    )
    plans = assign_readers(keys, sizes, bundle_bytes=bundle, solo_bytes=solo, hosts=hosts)
    holders = {k: sorted({r for r in range(n) if k in held[r]}) for k in range(universe)}
    # simulate: a rank reads what it does not receive; each message is its sender's bundles in order
    reads = {k: set() for k in range(universe)}
    for r in range(n):
        recv = {int(i) for msgs in plans[r]["recv"].values() for p in msgs for i in p}
        for i, k in enumerate(held[r]):
            if i not in recv:
                reads[k].add(r)
    for k, rs in holders.items():
        shared = sum(h.count(k) for h in held) > 1
        if not rs:
            continue
        if not shared:
            assert reads[k] == set(rs)
        elif hosts is None:
            assert len(reads[k]) == 1, (k, reads[k], rs)
        else:  # read on one host only, by every holder there
            (h,) = {int(hosts[r]) for r in reads[k]}
            assert reads[k] == {r for r in rs if hosts[r] == h}, (k, reads[k], rs, hosts)
    for src in range(n):
        msgs: dict[int, list[list[int]]] = {}
        for pieces, dsts in plans[src]["send"]:
            if len(pieces) > 1:  # packed bundles hold small pieces only, within the bundle size
                assert all(size_of[held[src][i]] < solo for i in pieces.tolist())
                assert sum(size_of[held[src][i]] for i in pieces.tolist()) <= bundle
            for d in dsts.tolist():
                msgs.setdefault(d, []).append([held[src][i] for i in pieces.tolist()])
        for dst in range(n):
            want = [[held[dst][i] for i in p.tolist()] for p in plans[dst]["recv"].get(src, [])]
            assert msgs.get(dst, []) == want, (src, dst)


def test_parse_record_of_any_torch_save():
    for t in (torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.tensor(2), torch.randn(4, 6)[:, 1:3]):
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        rec = parse_tensor_record(buf)
        assert rec.dtype == t.dtype and rec.shape == tuple(t.shape)
        if rec.contiguous:
            raw = buf.getvalue()[rec.data_offset : rec.data_offset + rec.nbytes]
            assert raw == t.contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else len(raw) == t.nbytes


def test_stock_tools_read_our_files_and_checksums_catch_a_flipped_byte(tmp_path):
    torch.manual_seed(0)
    sd = {"model": {"w": torch.randn(300, 200), "b": torch.randn(7).to(torch.bfloat16)}, "step": 3}
    dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path), planner=UCPSavePlanner())
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    io_info = md.storage_data[MetadataIndex(IO_KEY)]
    # 240 KB: 118 blocks of 2 KiB (format.checksum_block), the block recorded in the entry
    assert io_info["algo"] == TABLE_HASH and len(io_info["items"]["model.w|0,0"][1]) == 118
    assert io_info["items"]["model.w|0,0"][4] == 2048
    # stock reader, stock planner, dcp_to_torch_save
    back = {"model": {"w": torch.zeros(300, 200), "b": torch.zeros(7, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(back, checkpoint_id=tmp_path, planner=DefaultLoadPlanner())
    assert torch.equal(back["model"]["w"], sd["model"]["w"]) and back["step"] == 3
    dcp_to_torch_save(tmp_path, tmp_path / "full.pt")
    assert torch.equal(torch.load(tmp_path / "full.pt")["model"]["b"], sd["model"]["b"])
    # ours, reading a box of w into bf16 (dtype conversion on the ranged path)
    part = {"model": {"w": torch.zeros(300, 200, dtype=torch.bfloat16)}}
    reader = UCPFileSystemReader(tmp_path)
    dcp.load(part, storage_reader=reader, planner=UCPLoadPlanner(allow_partial_load=True))
    assert torch.equal(part["model"]["w"], sd["model"]["w"].to(torch.bfloat16))
    assert reader.stats.bytes_read == 300 * 200 * 4 and reader.stats.fallbacks == 0
    # torch.save's zip CRC32 was skipped (the block checksums cover the bytes), and only while writing
    from torch.utils.serialization import config

    def zip_ok(folder, fqn) -> bool:
        inf = dcp.FileSystemReader(folder).read_metadata().storage_data[MetadataIndex(fqn, (0, 0))]
        item = (folder / inf.relative_path).read_bytes()[inf.offset : inf.offset + inf.length]
        return zipfile.ZipFile(io.BytesIO(item)).testzip() is None

    assert config.save.compute_crc32 and not zip_ok(tmp_path, "model.w")
    dcp.save(sd, storage_writer=UCPFileSystemWriter(tmp_path / "crc", checksums=False), planner=UCPSavePlanner())
    assert zip_ok(tmp_path / "crc", "model.w")
    # flip one byte inside w's tensor data: the stock reader cannot tell, ours names file and atom
    info = md.storage_data[MetadataIndex("model.w", (0, 0))]
    path = tmp_path / info.relative_path
    raw = bytearray(path.read_bytes())
    raw[info.offset + io_info["items"]["model.w|0,0"][0] + 1000] ^= 0x40
    path.write_bytes(bytes(raw))
    err = expect_ucp_error(
        lambda: dcp.load(
            {"model": {"w": torch.zeros(300, 200)}},
            storage_reader=UCPFileSystemReader(tmp_path),
            planner=UCPLoadPlanner(allow_partial_load=True),
        ),
        ucp_dcp.ChecksumError,
    )
    assert info.relative_path in str(err) and "model.w" in str(err) and err.atom == "model.w"
    # verification off: the corrupt bytes load (that is what the checksum is for)
    dcp.load(
        {"model": {"w": torch.zeros(300, 200)}},
        storage_reader=UCPFileSystemReader(tmp_path, verify_checksums=False),
        planner=UCPLoadPlanner(allow_partial_load=True),
    )
    # a checksum algorithm this version does not know: read unverified, with a warning saying so
    md.storage_data[MetadataIndex(IO_KEY)]["algo"] = "sha9"
    rewrite_metadata(tmp_path, md)
    with pytest.warns(UserWarning, match="cannot verify"):
        dcp.load(
            {"model": {"w": torch.zeros(300, 200)}},
            storage_reader=UCPFileSystemReader(tmp_path),
            planner=UCPLoadPlanner(allow_partial_load=True),
        )


def test_a_failed_save_over_a_checkpoint_leaves_it_loadable(tmp_path):
    dcp.save({"w": torch.ones(4)}, storage_writer=UCPFileSystemWriter(tmp_path), planner=UCPSavePlanner())
    before = sorted(p.name for p in tmp_path.iterdir())

    class Boom(UCPSavePlanner):
        def resolve_data(self, item):
            raise RuntimeError("disk full")

    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.zeros(4)}, storage_writer=UCPFileSystemWriter(tmp_path), planner=Boom())
    back = {"w": torch.zeros(4)}
    ucp_dcp.load(back, tmp_path)
    assert torch.equal(back["w"], torch.ones(4)), "the old checkpoint must survive a save that failed"
    assert set(before) <= {p.name for p in tmp_path.iterdir()}


# -- multi-rank: resharding reads, read-once, failures -------------------------------------------------


def _needed(target):
    return target.to_local().numel() * target.to_local().element_size()


class _no_mapping:
    """Make the reader treat local files like remote ones (no memory mapping: ranged preads)."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        import ucp_dcp.storage.reader as R

        self.saved = R.regular_fd
        if self.on:
            R.regular_fd = lambda f: None

    def __exit__(self, *exc):
        import ucp_dcp.storage.reader as R

        R.regular_fd = self.saved


# (save ranks, save mesh, save placements, load ranks, load mesh, load placements); meshes by size, or "2x2"
RESHARD = {
    "1->4": (1, 1, [Shard(0)], 4, 4, [Shard(0)]),
    "4->3": (4, 4, [Shard(0)], 3, 3, [Shard(0)]),
    "2->4": (2, 2, [Shard(0)], 4, 4, [Shard(0)]),
    "4->4": (4, 4, [Shard(0)], 4, 4, [Shard(0)]),
    "tp-dim": (4, 4, [Shard(0)], 4, 4, [Shard(1)]),
    "strided": (4, "2x2", [Shard(0), _StridedShard(0, split_factor=2)], 3, 3, [Shard(1)]),
}
READ_PATHS = ("mapped", "mapped+verify", "pread", "pread+verify")


def _full():
    return torch.arange(96 * 40, dtype=torch.float32).reshape(96, 40)


def _mesh(n):
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2)) if n == "2x2" else DeviceMesh("cpu", torch.arange(n))


def _reshard_worker(rank, world, root, name):
    """Save at one layout, load at another through every read path; per path this rank's
    (bitwise, bytes read, bytes needed, verifying, fallbacks), or None when not loading."""
    ns, ms, ps, nl, ml, pl = RESHARD[name]
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 3)}
    meshes = {n: _mesh(n) for n in (1, 2, 3, 4, "2x2")}  # every rank builds every mesh
    full, path = _full(), f"{root}/{name}"
    if rank < ns:
        src = distribute_tensor(full, meshes[ms], ps, src_data_rank=None)
        dcp.save(
            {"w": src}, storage_writer=UCPFileSystemWriter(path), planner=UCPSavePlanner(), process_group=groups.get(ns)
        )
    dist.barrier()
    if rank >= nl:
        return None
    expect = distribute_tensor(full, meshes[ml], pl, src_data_rank=None).to_local()
    stats = []
    # local files (strided boxes via mapped windows) and the pread path remote files take,
    # each with checksum verification off (exact byte count) and on
    for mapped, verify in ((True, False), (True, True), (False, False), (False, True)):
        tgt = distribute_tensor(torch.zeros_like(full), meshes[ml], pl, src_data_rank=None)
        reader = UCPFileSystemReader(path, verify_checksums=verify)
        with _no_mapping(not mapped):
            dcp.load({"w": tgt}, storage_reader=reader, planner=UCPLoadPlanner(), process_group=groups.get(nl))
        stats.append(
            (
                bool(torch.equal(tgt.to_local(), expect)),
                reader.stats.bytes_read,
                _needed(tgt),
                verify,
                reader.stats.fallbacks,
            )
        )
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESHARD))
def test_ranged_reads_reshard_bitwise_reading_only_what_is_needed(name):
    res = D.run(_reshard_worker, 4, D.tmpdir(), name, timeout=300)
    per_rank = [r for r in res if r is not None]
    assert len(per_rank) == RESHARD[name][3]
    problems = []
    for k, path in enumerate(READ_PATHS):
        runs = [r[k] for r in per_rank]
        if not all(ok for ok, *_ in runs):
            problems.append(f"{name} {path}: not bitwise")
        if not all(fb == 0 for *_, fb in runs):
            problems.append(f"{name} {path}: fell back to whole-item reads")
        read, needed = sum(r[1] for r in runs), sum(r[2] for r in runs)
        if runs[0][3]:  # verifying reads the whole blocks it touches (1 KiB here: tests/storage/test_block_sizes.py)
            if not needed <= read <= 96 * 40 * 4 * len(runs):
                problems.append(f"{name} {path}: read {read}")
        elif read != needed:
            problems.append(f"{name} {path}: read {read} bytes for {needed} needed")
    assert not problems, problems


def _damage_worker(rank, world, root, damage):
    """Damage on the strided path: a flipped byte or a truncated file is an error on every rank."""
    full, path = _full(), f"{root}/tp-dim-{damage}"
    mesh = DeviceMesh("cpu", torch.arange(4))
    src = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    dcp.save({"w": src}, storage_writer=UCPFileSystemWriter(path), planner=UCPSavePlanner())
    if rank == 0:
        md = dcp.FileSystemReader(path).read_metadata()
        info = md.storage_data[MetadataIndex("w", (24, 0))]
        fn = os.path.join(path, info.relative_path)
        raw = bytearray(open(fn, "rb").read())
        if damage == "flip":
            raw[info.offset + md.storage_data[MetadataIndex(IO_KEY)]["items"]["w|24,0"][0] + 40 * 4 * 5 + 7] ^= 2
        else:
            raw = raw[: info.offset + md.storage_data[MetadataIndex(IO_KEY)]["items"]["w|24,0"][0] + 1000]
        open(fn, "wb").write(bytes(raw))
    dist.barrier()
    try:
        dcp.load(
            {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)], src_data_rank=None)},
            storage_reader=UCPFileSystemReader(path),
            planner=UCPLoadPlanner(),
        )
        return None
    except CheckpointException as e:
        return str(ucp_dcp.first_ucp_error(e))


@pytest.mark.slow
@pytest.mark.parametrize("damage, text", [("flip", "checksum mismatch"), ("truncate", "w")])
def test_damaged_file_on_the_strided_path_is_an_error_on_every_rank(damage, text):
    res = D.run(_damage_worker, 4, D.tmpdir(), damage, timeout=300)
    assert all(r is not None for r in res), f"{damage}: some rank loaded without error"
    assert any(text in r for r in res) and any("w" in r for r in res), res
    if damage == "truncate":
        assert any("truncated" in r or "ended early" in r for r in res), res


def _tp_dim_verified_worker(rank, world, root, flip):
    """tp-dim with checksums verified (the default) on a tensor large enough for tile sums: each rank
    reads its column slice of every saved row block and nothing else, or a flipped byte is an error."""
    full = torch.arange(512 * 2048, dtype=torch.float32).reshape(512, 2048) / 7
    mesh, path = DeviceMesh("cpu", torch.arange(4)), f"{root}/tp-dim-tiles-{flip}"
    dcp.save(
        {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)},
        storage_writer=UCPFileSystemWriter(path),
        planner=UCPSavePlanner(),
    )
    if flip and rank == 0:
        md = dcp.FileSystemReader(path).read_metadata()
        info = md.storage_data[MetadataIndex("w", (128, 0))]
        at = info.offset + md.storage_data[MetadataIndex(IO_KEY)]["items"]["w|128,0"][0] + (5 * 2048 + 1500) * 4
        with open(os.path.join(path, info.relative_path), "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 4]))
    dist.barrier()
    tgt = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)], src_data_rank=None)
    reader = UCPFileSystemReader(path)
    try:
        dcp.load({"w": tgt}, storage_reader=reader, planner=UCPLoadPlanner())
    except CheckpointException as e:
        return str(ucp_dcp.first_ucp_error(e))
    expect = distribute_tensor(full, mesh, [Shard(1)], src_data_rank=None).to_local()
    return bool(torch.equal(tgt.to_local(), expect)), reader.stats.bytes_read, tgt.to_local().nbytes


@pytest.mark.slow
def test_verified_tp_dim_reads_only_the_column_slices():
    res = D.run(_tp_dim_verified_worker, 4, D.tmpdir(), False, timeout=300)
    assert all(ok for ok, _, _ in res), res
    assert all(read == needed for _, read, needed in res), res  # whole checksum blocks would read 4x


@pytest.mark.slow
def test_verified_tp_dim_catches_a_flipped_byte_in_the_slice_it_reads():
    res = D.run(_tp_dim_verified_worker, 4, D.tmpdir(), True, timeout=300)
    # the byte is in columns [1500, 1501): rank 2's slice [1024, 1536) of row block [128, 256)
    assert isinstance(res[2], str) and "tile" in res[2] and "checksum mismatch" in res[2], res
    assert all(isinstance(r, str) or r[0] for r in res), res


def _save_replicated(root):
    """HSDP-like replicas ([Replicate, Shard(0)] on 2x2) plus an object every rank needs."""
    mesh22 = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    rep = distribute_tensor(_full(), mesh22, [Replicate(), Shard(0)])
    dcp.save({"w": rep, "step": 7}, storage_writer=UCPFileSystemWriter(f"{root}/rep"), planner=UCPSavePlanner())
    return mesh22, rep


def _read_once_worker(rank, world, root, mode, hosts):
    mesh22, rep = _save_replicated(root)
    D.setenv("UCP_DCP_HOST", f"node{rank // 2}" if hosts else None)
    tgt = distribute_tensor(torch.zeros_like(_full()), mesh22, [Replicate(), Shard(0)])
    sd = {"w": tgt, "step": 0}
    reader = UCPFileSystemReader(f"{root}/rep")
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(read_once=mode))
    return (
        bool(torch.equal(tgt.to_local(), rep.to_local())),
        sd["step"],
        sorted(set(reader.stats.items)),
        reader.stats.bytes_received,
    )


def _readers(res):
    out = {}
    for rank, (ok, step, items, _received) in enumerate(res):
        assert ok and step == 7, rank
        for item in items:
            out.setdefault(item, []).append(rank)
    return out, sum(r[3] for r in res)


@pytest.mark.slow
def test_read_once_by_ranks_reads_every_item_once():
    got, received = _readers(D.run(_read_once_worker, 4, D.tmpdir(), "ranks", False, timeout=300))
    # every saved item (2 chunks of w, the step object) is read by exactly one rank
    assert sorted(got) == ["step|", "w|0,0", "w|48,0"] and all(len(v) == 1 for v in got.values()), got
    assert received > 0


@pytest.mark.slow
def test_read_once_by_hosts_reads_each_chunk_on_one_host():
    # ranks {0,1} and {2,3} simulated as two hosts (the replica partners (0,2), (1,3) on different hosts)
    got, received = _readers(D.run(_read_once_worker, 4, D.tmpdir(), "hosts", True, timeout=300))
    assert all(len(got[k]) == 1 for k in ("w|0,0", "w|48,0")), got
    assert len({r // 2 for r in got["step|"]}) == 1, got
    assert received >= 2 * 48 * 40 * 4


@pytest.mark.slow
def test_read_once_by_hosts_on_one_host_sends_nothing():
    # the page cache already shares the bytes, so every rank reads its own, nothing is sent
    got, received = _readers(D.run(_read_once_worker, 4, D.tmpdir(), "hosts", False, timeout=300))
    assert received == 0 and sorted(got["w|0,0"]) == [0, 2], got


def _failing_load_worker(rank, world, root, damage):
    """A broken replicated checkpoint loaded across two simulated hosts (the load sends across them):
    every rank must raise, none may hang."""
    mesh22, _ = _save_replicated(root)
    D.setenv("UCP_DCP_HOST", f"node{rank // 2}")
    md = dcp.FileSystemReader(f"{root}/rep").read_metadata()
    if rank == 0 and damage == "corrupt":  # the file holding the replicated chunk of rows 0..47
        info = md.storage_data[MetadataIndex("w", (0, 0))]
        entry = md.storage_data[MetadataIndex(IO_KEY)]["items"]["w|0,0"]
        p = os.path.join(f"{root}/rep", info.relative_path)
        raw = bytearray(open(p, "rb").read())
        raw[info.offset + entry[0] + 8] ^= 1
        open(p, "wb").write(bytes(raw))
    if rank == 0 and damage == "missing":  # a missing data file on the reading rank
        os.remove(os.path.join(f"{root}/rep", md.storage_data[MetadataIndex("w", (48, 0))].relative_path))
    dist.barrier()
    try:
        dcp.load(
            {"w": distribute_tensor(torch.zeros_like(_full()), mesh22, [Replicate(), Shard(0)])},
            storage_reader=UCPFileSystemReader(f"{root}/rep"),
            planner=UCPLoadPlanner(allow_partial_load=True),
        )
        return None
    except CheckpointException as e:
        return sorted({type(exc).__name__ for exc, _ in e.failures.values()}), str(ucp_dcp.first_ucp_error(e))


@pytest.mark.slow
def test_a_checksum_failure_on_the_reading_rank_raises_on_every_rank():
    res = D.run(_failing_load_worker, 4, D.tmpdir(), "corrupt", timeout=300)
    assert all(r is not None for r in res), res  # no rank loaded, none deadlocked
    kinds, text = res[0]
    assert "ChecksumError" in kinds, kinds
    assert "checksum mismatch" in text, text


@pytest.mark.slow
def test_a_missing_data_file_is_an_error_everywhere_not_a_hang():
    res = D.run(_failing_load_worker, 4, D.tmpdir(), "missing", timeout=300)
    assert all(r is not None for r in res), res
    assert "MissingFileError" in res[0][0], res[0]
