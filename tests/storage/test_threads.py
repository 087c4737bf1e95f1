"""Reading threads from the machine, and a rank's reads cut into work for them (ucp_dcp.storage.file_ranges)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import expect_ucp_error
from hypothesis import given
from hypothesis import strategies as st

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPLoadPlanner
from ucp_dcp.errors import ChecksumError
from ucp_dcp.storage.file_ranges import MAX_THREADS, MIN_THREADS, reading_threads, split_work

files_ = st.lists(st.lists(st.integers(0, 1000), max_size=12), max_size=5)


@given(files_, st.integers(1, 20))
def test_split_work_keeps_every_chunk_once_in_file_order(sizes, threads):
    files = [(f"f{i}", [(i, k, n) for k, n in enumerate(cs)]) for i, cs in enumerate(sizes)]
    work = split_work(files, threads, lambda c: c[2])
    assert [c for _, run in work for c in run] == [c for _, cs in files for c in cs]
    assert all(run and all(c[0] == int(rel[1:]) for c in run) for rel, run in work)


@given(files_, st.integers(2, 20))
def test_split_work_cuts_runs_near_a_fair_share(sizes, threads):
    files = [(f"f{i}", [(i, k, n) for k, n in enumerate(cs)]) for i, cs in enumerate(sizes)]
    work = split_work(files, threads, lambda c: c[2])
    total = sum(n for cs in sizes for n in cs)
    share = -(-total // threads) if total else 0
    # a run over the share is a single chunk; a run is cut only when the next chunk would pass the share
    assert all(len(run) == 1 or sum(c[2] for c in run) <= share for _, run in work)
    for (rel, run), (rel2, nxt) in zip(work, work[1:]):
        if rel == rel2 and total:
            assert sum(c[2] for c in run) + nxt[0][2] > share


def test_one_large_file_becomes_one_task_per_thread():
    chunks = [("f", k, 64) for k in range(32)]
    work = split_work([("f", chunks)], 8, lambda c: c[2])
    assert len(work) == 8 and all(len(run) == 4 for _, run in work)


@pytest.mark.parametrize(
    "cores,local,want",
    [(16, 1, 16), (64, 1, MAX_THREADS), (16, 4, 4), (2, 4, MIN_THREADS), (16, 8, 2), (1, 1, MIN_THREADS)],
)
def test_reading_threads_share_the_cores_among_the_hosts_ranks(cores, local, want):
    assert reading_threads(cores, local) == want


def test_reading_threads_read_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert reading_threads(16) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert reading_threads(16) == 16


def _state():
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(64, 256, generator=g) for i in range(24)}


def test_one_file_of_many_chunks_is_read_by_several_threads_bitwise(tmp_path):
    """The default save writes one file; a reader with 4 threads cuts it into 4 runs of whole chunks
    (ReadStats.tasks) and loads every tensor bitwise, checksums verified."""
    state = _state()
    ucp_dcp.save(state, tmp_path)
    assert len(list(tmp_path.glob("*.distcp"))) == 1
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = UCPFileSystemReader(tmp_path, thread_count=4)
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.stats.tasks == 4
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_a_flipped_byte_is_caught_by_whichever_thread_reads_it(tmp_path):
    state = _state()
    ucp_dcp.save(state, tmp_path)
    (f,) = tmp_path.glob("*.distcp")
    raw = bytearray(f.read_bytes())
    at = bytes(raw).index(state["t22"].numpy().tobytes())  # a tensor of the last of the 4 runs
    raw[at + 1000] ^= 0x01
    f.write_bytes(bytes(raw))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    err = expect_ucp_error(
        lambda: dcp.load(out, storage_reader=UCPFileSystemReader(tmp_path, thread_count=4), planner=UCPLoadPlanner()),
        ChecksumError,
    )
    assert err.atom == "t22", err


def test_the_default_thread_count_comes_from_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert UCPFileSystemReader(tmp_path).thread_count == reading_threads()
    assert UCPFileSystemReader(tmp_path, thread_count=3).thread_count == 3
