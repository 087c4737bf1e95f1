"""Checksum blocks scaled to each record (issue 47, "verified reads at every chunk size"), single process.

A verified read of part of a record reads the whole checksum blocks it touches. With one 1 MiB block for
every record, a rank needing half of a 64 KiB chunk read all of it; the writer now gives each tensor record a
block of a 64th of its size (a power of two, 1 KiB to 1 MiB: ``format.checksum_block``) and records it in
the record's I/O-table entry, so the bytes a load reads stay within ``1 + cuts/64`` of the bytes it needs.
Checkpoints written before (I/O table version 3, one ``"block"`` for all) load and verify as they did:
``data/blocks_v3`` was written by ucp_dcp at commit 3e85444 (``ucp_dcp.save`` of :func:`_v3_state`).
The multi-rank loads: ``tests/storage/test_small_blocks_dist.py``.
"""

from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import ucp_dcp
from ucp_dcp.errors import ChecksumError, CorruptCheckpointError
from ucp_dcp.storage.format import (
    BLOCK,
    BLOCKS_PER_RECORD,
    IO_KEY,
    MIN_BLOCK,
    TABLE_HASH,
    BlockChecker,
    BlockSums,
    block_checksums,
    blocks_touching,
    checksum_block,
    entry_sums,
)
from ucp_dcp.tools.dryrun.read_cost import CostModel, ReadCost
from ucp_dcp.tools.verify import verify

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

V3_FIXTURE = Path(__file__).parent / "data" / "blocks_v3"
INDEX = MetadataIndex("w", torch.Size([0]))


# -- the block rule ---------------------------------------------------------------------------------------


@given(st.integers(0, 1 << 34))
def test_the_block_is_the_largest_power_of_two_a_64th_of_the_record_within_1_kib_and_1_mib(n):
    b = checksum_block(n)
    assert b & (b - 1) == 0 and MIN_BLOCK <= b <= BLOCK
    if n >= BLOCKS_PER_RECORD * MIN_BLOCK:
        assert BLOCKS_PER_RECORD * b <= n  # at least 64 blocks: the bound below
        assert b == BLOCK or BLOCKS_PER_RECORD * 2 * b > n  # and no smaller than that needs (fewer sums)
    else:
        assert b == MIN_BLOCK
    assert checksum_block(n) <= checksum_block(n + 1)  # monotone: a larger record never gets a finer block


@pytest.mark.parametrize(
    "n, block, sums",
    [
        (96, 1 << 10, 1),  # under 1 KiB: one block, the whole record (as with 1 MiB blocks)
        (64 << 10, 1 << 10, 64),  # the goal's smallest chunk: 64 blocks of 1 KiB
        (1 << 20, 16 << 10, 64),
        ((16 << 20) - 4, 128 << 10, 128),  # just under a power of two: up to 128 blocks
        (64 << 20, 1 << 20, 64),  # 64 MiB and more keep 1 MiB blocks (the 1 GiB benchmark's 1-rank chunks)
        (1 << 30, 1 << 20, 1024),
    ],
)
def test_block_sizes_at_the_sizes_that_matter(n, block, sums):
    assert checksum_block(n) == block and -(-n // block) == sums


# -- blocks a read touches, per record --------------------------------------------------------------------


@st.composite
def record_cuts(draw):
    """A record of ``n`` bytes with its own block, cut at sorted places into pieces (one per reading rank)."""
    n = draw(st.one_of(st.integers(1, 1 << 16), st.integers(1 << 16, 1 << 26)))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=7)))) if n > 1 else []
    return n, checksum_block(n), cuts


@given(record_cuts())
def test_a_load_cutting_a_record_k_times_reads_at_most_k_blocks_more_than_the_record(case):
    """Each rank's piece widened to the blocks it touches (``blocks_touching``, what a verified read
    fetches): together at most one block per cut beyond the record, so ``<= 1 + k/64`` of it for records of
    64 KiB and more (``<= 1.047`` for the 3 cuts of a 1 -> 4 load)."""
    n, B, cuts = case
    edges = [0, *cuts, n]
    total = 0
    for s, e in zip(edges, edges[1:]):
        widened = blocks_touching([(s, e - s)], n, B)
        assert len(widened) == 1
        a, m = widened[0]
        # aligned to the record's blocks (or its end), covering the piece, less than a block wider each side
        assert a % B == 0 and (a + m == n or (a + m) % B == 0)
        assert a <= s and e <= a + m and s - a < B and a + m - e < B
        total += m
    assert total <= n + len(cuts) * B
    if n >= BLOCKS_PER_RECORD * MIN_BLOCK and n < BLOCKS_PER_RECORD * BLOCK:
        assert total <= n * (1 + len(cuts) / BLOCKS_PER_RECORD)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), max_size=6), st.sampled_from([1024, 4096]))
def test_blocks_touching_is_the_merged_union_of_the_blocks_of_each_interval(intervals, block):
    n = 9000
    intervals = [(s, min(m, n - s)) for s, m in intervals if s < n]
    got = blocks_touching(intervals, n, block)
    want = set()
    for s, m in intervals:
        want.update(range(s // block, -(-(s + m) // block)))
    covered = set()
    for a, m in got:
        covered.update(range(a // block, -(-(a + m) // block)))
    assert covered == want
    assert all(a + m < b for (a, m), (b, _) in zip(got, got[1:]))  # disjoint, not touching (merged)


# -- verification with a record's own block ---------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300_000), st.data())
def test_a_span_is_verified_reading_only_the_edges_of_its_blocks_and_a_flipped_byte_is_caught(n, data):
    """``BlockChecker.verify_span`` (the direct read path) reads the parts of its first and last block outside
    the span, exactly what ``plan``'s cost model counts for it, and any flipped byte of a block it touches is
    a ``ChecksumError`` naming that block."""
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    B = checksum_block(n)
    sums = BlockSums(B, block_checksums(memoryview(raw), B))
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    reads: list[tuple[int, int]] = []

    def pread(off, m):
        reads.append((off, m))
        return memoryview(raw[off : off + m])

    checker = BlockChecker("xxh3_64")
    checker.verify_span(pread, 0, start, memoryview(raw[start:end]), sums, n, "f", INDEX)
    b0, b1 = start // B, (end - 1) // B
    assert sum(m for _, m in reads) == min((b1 + 1) * B, n) - b0 * B - (end - start)
    cost = ReadCost()
    CostModel(Metadata(state_dict_metadata={}, storage_data={}), None)._edges(cost, INDEX, start, end - start, n, B)
    assert (cost.bytes_read, cost.ranges) == (sum(m for _, m in reads), len(reads))
    flip = data.draw(st.integers(b0 * B, min((b1 + 1) * B, n) - 1))
    bad = bytearray(raw)
    bad[flip] ^= 1
    with pytest.raises(ChecksumError, match=rf"block {flip // B} \(bytes {flip // B * B}\.\."):
        checker.verify_span(
            lambda off, m: memoryview(bytes(bad[off : off + m])),
            0,
            start,
            memoryview(bytes(bad[start:end])),
            sums,
            n,
            "f",
            INDEX,
        )


def test_an_entry_gives_its_own_block_else_the_tables():
    v3 = [704, [1, 2], 3, None]  # I/O table version 3: the table's block
    v4 = [704, [1, 2, 3], 4, None, 4096]
    assert entry_sums(v3, BLOCK) == BlockSums(BLOCK, [1, 2])
    assert entry_sums(v4, BLOCK) == BlockSums(4096, [1, 2, 3])
    assert entry_sums([0, [5], None], BLOCK) == BlockSums(BLOCK, [5])  # an object
    assert not entry_sums(None, BLOCK) and not entry_sums([704, [], 1, None, 1024], BLOCK)
    for bad in (0, -1, "4096", 1.5, True):
        with pytest.raises(CorruptCheckpointError, match="checksum block"):
            entry_sums([704, [1], 2, None, bad], BLOCK, INDEX)


# -- what the writer records, and loads of both table versions -------------------------------------------


def _io(path) -> dict:
    md = pickle.loads((Path(path) / ".metadata").read_bytes())  # our own checkpoint: trusted
    return md.storage_data[MetadataIndex(IO_KEY)], md


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(128, 128, generator=g),  # 64 KiB: 64 blocks of 1 KiB
        "v": torch.randn(3 << 18, generator=g),  # 3 MiB: 48 KiB / block -> 32 KiB, 96 blocks
        "b": torch.randn(5, generator=g),  # 20 bytes: one block
        "e": torch.zeros(0),  # empty: no sums
        "step": 4,
    }


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def test_the_writer_records_each_tensors_block_and_its_sums(tmp_path):
    sd = _state()
    ucp_dcp.save(sd, tmp_path)
    io, _ = _io(tmp_path)
    assert io["version"] == 4 and io["block"] == BLOCK
    for name in ("w", "v", "b"):
        entry = io["items"][f"{name}|{','.join(['0'] * sd[name].dim())}"]
        n = sd[name].nbytes
        assert entry[4] == checksum_block(n)
        assert entry[1] == block_checksums(memoryview(sd[name].numpy().tobytes()), entry[4])
        assert len(entry[1]) == -(-n // entry[4])
    assert len(io["items"]["step|"]) == 3  # objects: read whole, the table's 1 MiB block
    out = _zeros(sd)
    ucp_dcp.load(out, tmp_path)
    assert all(torch.equal(out[k], sd[k]) for k in ("w", "v", "b", "e")) and out["step"] == 4
    assert verify(tmp_path).status == "ok"  # the empty tensor included (it has no sums to match)


def _flip(path, fqn: str, offsets: tuple[int, ...], at: int) -> None:
    """Flip one bit of byte ``at`` of chunk ``fqn@offsets``'s data."""
    io, md = _io(path)
    index = MetadataIndex(fqn, torch.Size(offsets))
    info = md.storage_data[index]
    entry = io["items"][f"{fqn}|{','.join(map(str, offsets))}"]
    with open(Path(path) / info.relative_path, "r+b") as f:
        f.seek(info.offset + entry[0] + at)
        b = f.read(1)
        f.seek(info.offset + entry[0] + at)
        f.write(bytes([b[0] ^ 4]))


def test_a_flipped_byte_in_a_small_block_is_caught_naming_that_block(tmp_path):
    sd = _state()
    ucp_dcp.save(sd, tmp_path)
    _flip(tmp_path, "w", (0, 0), 37 * 1024 + 5)  # block 37 of w's 64 blocks of 1 KiB
    with pytest.raises(ChecksumError, match=r"'w' chunk at \[0, 0\]: block 37 \(bytes 37888\.\."):
        ucp_dcp.load(_zeros(sd), tmp_path)
    report = verify(tmp_path)
    assert report.status == "corrupt" and len(report.problems) == 1
    assert "block 37 (bytes 37888..38912" in report.problems[0].what and report.problems[0].box == "[74:76, 0:128]"


def test_a_reader_from_before_per_record_blocks_reads_unverified_with_a_warning_not_a_false_checksum_error(
    tmp_path, monkeypatch
):
    """A ucp_dcp before version 4 knows one algorithm name, ``xxh3_64``, and reads every entry's sums as the
    table's 1 MiB block: on a table that recorded that name it failed every tensor over 1 KiB with a false
    ``ChecksumError``. The table names its algorithm :data:`TABLE_HASH` (the same digests), so such a reader
    takes its unknown-algorithm path (reader.py at 3e85444: warn, read unverified). Simulated here by a
    reader whose table of algorithms holds that one name."""
    import xxhash

    from ucp_dcp.storage import reader as reader_mod

    sd = _state()
    ucp_dcp.save(sd, tmp_path)
    io, _ = _io(tmp_path)
    assert io["algo"] == TABLE_HASH != "xxh3_64"
    monkeypatch.setattr(reader_mod, "HASHES", {"xxh3_64": xxhash.xxh3_64})
    out = _zeros(sd)
    with pytest.warns(UserWarning, match="cannot verify"):
        ucp_dcp.load(out, tmp_path)
    assert all(torch.equal(out[k], sd[k]) for k in ("w", "v", "b", "e")) and out["step"] == 4


def test_a_version_4_table_that_recorded_xxh3_64_still_verifies_its_per_record_blocks(tmp_path):
    """Main wrote ``"algo": "xxh3_64"`` in version-4 tables before :data:`TABLE_HASH` (2026-12-02): those
    load and verify with their per-record blocks as before."""
    from helpers import rewrite_metadata

    sd = _state()
    ucp_dcp.save(sd, tmp_path)
    io, md = _io(tmp_path)
    io["algo"] = "xxh3_64"
    rewrite_metadata(tmp_path, md)
    out = _zeros(sd)
    ucp_dcp.load(out, tmp_path)
    assert all(torch.equal(out[k], sd[k]) for k in ("w", "v", "b", "e"))
    assert verify(tmp_path).status == "ok"
    _flip(tmp_path, "w", (0, 0), 37 * 1024 + 5)
    with pytest.raises(ChecksumError, match=r"'w' chunk at \[0, 0\]: block 37 "):
        ucp_dcp.load(_zeros(sd), tmp_path)


def _v3_state() -> dict:
    return {
        "model": {
            "w": (torch.arange(64 * 64, dtype=torch.float32) / 7).reshape(64, 64),
            "b": torch.arange(2048, dtype=torch.float32).to(torch.bfloat16),
        },
        "train": {"step": 11},
    }


def _v3_target() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(2048, dtype=torch.bfloat16)}, "train": {"step": None}}


def test_a_checkpoint_with_one_block_for_all_records_loads_and_verifies_as_before(tmp_path):
    """The fixture's table is version 3: one ``"block"`` (1 MiB) for every record, entries of four elements,
    so its 16 KiB and 4 KiB records have one sum each (this version would write 16 and 4)."""
    ckpt = tmp_path / "v3"
    shutil.copytree(V3_FIXTURE, ckpt)
    io, _ = _io(ckpt)
    assert io["version"] == 3 and io["block"] == BLOCK
    assert [len(io["items"][k]) for k in ("model.w|0,0", "model.b|0")] == [4, 4]
    assert [len(io["items"][k][1]) for k in ("model.w|0,0", "model.b|0")] == [1, 1]
    out = _v3_target()
    ucp_dcp.load(out, ckpt)
    want = _v3_state()
    assert torch.equal(out["model"]["w"], want["model"]["w"]) and torch.equal(out["model"]["b"], want["model"]["b"])
    assert out["train"]["step"] == 11
    assert verify(ckpt).status == "ok"
    # a flipped byte in its (1 MiB, whole-record) block: still an error, naming block 0
    _flip(ckpt, "model.w", (0, 0), 9000)
    with pytest.raises(ChecksumError, match=r"'model.w' chunk at \[0, 0\]: block 0 \(bytes 0\.\."):
        ucp_dcp.load(_v3_target(), ckpt)
    report = verify(ckpt)
    assert report.status == "corrupt" and "block 0 (bytes 0..16384" in report.problems[0].what


def test_sums_a_10000_tensor_checkpoint_stores():
    """How many block sums (one ~20-byte JSON number each in the sidecar) the rule writes for 10,000 records
    of a given size, against one 1 MiB block for all: at most one per KiB of data (``MIN_BLOCK``), 64 to 128 per
    record from 64 KiB to 64 MiB, the same as before from 64 MiB."""

    def count(n: int, block: int) -> int:
        return 10_000 * -(-n // block)

    assert [count(n, checksum_block(n)) for n in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)] == [
        40_000,
        640_000,
        640_000,
        640_000,
        640_000,
    ]
    assert [count(n, BLOCK) for n in (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)] == [
        10_000,
        10_000,
        10_000,
        160_000,
        640_000,
    ]
    assert all(
        -(-n // checksum_block(n)) <= max(math.ceil(n / MIN_BLOCK), 2 * BLOCKS_PER_RECORD, math.ceil(n / BLOCK))
        for n in range(1, 1 << 27, 997)
    )
