"""The device data path, exercised on CPU: staging buffers, split items, ordering, transport groups.

``staging="always"`` sends CPU targets through the same code a CUDA target takes (bounded pool,
partial buffers, dtype conversion on copy, sub-boxes, read-once through staging); the only
difference on a GPU is that buffers are pinned and copies are non-blocking with events.
"""

import math

import dist as D
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import assert_written_by_ucp, expect_ucp_error
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ucp_dcp
from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner
from ucp_dcp.errors import ChecksumError, DtypeConversionError
from ucp_dcp.planning import device
from ucp_dcp.planning.collectives import carries_cpu
from ucp_dcp.planning.device import split_box, split_reads
from ucp_dcp.storage import staging
from ucp_dcp.storage.staging import HostCopies, StagingPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- the math --------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 7), min_size=0, max_size=4), st.sampled_from([1, 2, 4, 8]), st.integers(1, 200))
def test_split_box_pieces_are_consecutive_byte_ranges_within_cap(shape, itemsize, cap):
    cap = max(cap, itemsize)
    pieces = split_box(tuple(shape), itemsize, cap)
    t = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    flat = []
    for offs, lens in pieces:
        assert all(o + n <= s for o, n, s in zip(offs, lens, shape))
        if math.prod(shape):
            assert math.prod(lens) * itemsize <= cap
        flat.extend(t[tuple(slice(o, o + n) for o, n in zip(offs, lens))].reshape(-1).tolist())
    # the pieces, in order, are the box's row-major elements exactly once: contiguous byte ranges
    assert flat == t.reshape(-1).tolist()


def _item(lengths, dest=(0, 0), stor=(0, 0), kind=LoadItemType.TENSOR):
    return ReadItem(
        type=kind,
        dest_index=MetadataIndex("t", (0, 0)),
        dest_offsets=torch.Size(dest),
        storage_index=MetadataIndex("t", (0, 0)),
        storage_offsets=torch.Size(stor),
        lengths=torch.Size(lengths),
    )


def test_split_reads_shifts_both_offsets_and_leaves_others_alone():
    big, small = _item((10, 6), dest=(2, 1), stor=(5, 3)), _item((1, 2))
    out = split_reads([big, small], lambda it: 4, lambda it: True, cap=4 * 6 * 3)
    assert [tuple(it.lengths) for it in out] == [(3, 6), (3, 6), (3, 6), (1, 6), (1, 2)]
    assert [tuple(it.dest_offsets) for it in out[:4]] == [(2, 1), (5, 1), (8, 1), (11, 1)]
    assert [tuple(it.storage_offsets) for it in out[:4]] == [(5, 3), (8, 3), (11, 3), (14, 3)]
    assert split_reads([big], lambda it: 4, lambda it: False, cap=8) == [big]  # not staged: whole


class _Event:
    """A device event stand-in: completes when the test says so; records waits."""

    def __init__(self):
        self.done, self.waited = False, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_pool_reuses_a_buffer_only_after_its_copy_completes():
    pool = StagingPool(64, count=2)
    a = pool.acquire()
    ev = _Event()
    pool.release(a, ev)
    b = pool.acquire()  # a's copy is in flight: a second buffer, not a
    assert b.data_ptr() != a.data_ptr() and pool.stats.allocated == 2
    pool.release(b)
    c = pool.acquire()  # b is free at once
    assert c.data_ptr() == b.data_ptr() and ev.waited == 0
    d = pool.acquire()  # the pool is full: wait for the oldest copy, then reuse its buffer
    assert d.data_ptr() == a.data_ptr() and ev.waited == 1 and pool.stats.waits == 1
    assert pool.stats.allocated == 2 and pool.stats.peak_in_use == 2


def test_pool_drain_waits_for_every_copy_in_flight():
    pool = StagingPool(8, count=3)
    evs = [_Event() for _ in range(3)]
    for ev in evs:
        pool.release(pool.acquire(), ev)
    pool.drain()
    assert all(ev.done for ev in evs) and pool.stats.allocated == 3


def test_host_copies_are_copies_in_order_when_forced():
    ts = [torch.full((3,), float(i)) for i in range(5)]
    seen = list(HostCopies(list(range(5)), lambda i: ts[i], depth=2, forced=True))
    assert [i for i, _ in seen] == list(range(5))
    for i, h in seen:
        assert torch.equal(h, ts[i]) and h.data_ptr() != ts[i].data_ptr()
    passthrough = list(HostCopies([0], lambda i: ts[i]))  # CPU tensors, not forced: no copy
    assert passthrough[0][1].data_ptr() == ts[0].data_ptr()


@pytest.mark.parametrize(
    "backend,cpu",
    [
        ("gloo", True),
        ("nccl", False),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl", False),
        ("NCCL", False),
        ("mpi", True),
    ],
)
def test_which_groups_carry_host_bytes(backend, cpu):
    assert carries_cpu(backend) is cpu


# -- single-process loads through staging ------------------------------------------------------------


@pytest.fixture
def small_buffers(monkeypatch):
    """Staging buffers of 4 KiB: small tensors take the multi-piece, partial-buffer paths."""
    monkeypatch.setattr(device, "STAGE_BYTES", 4096)


def _load(sd, path, **kw):
    reader = UCPFileSystemReader(path, staging="always", thread_count=2)
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(**kw))
    return reader.stats


def test_staged_load_is_bitwise_and_bounded(tmp_path, small_buffers):
    g = torch.Generator().manual_seed(0)
    saved = {
        "w": torch.randn(100, 37, generator=g),
        "b": torch.randn(5, generator=g),
        "e": torch.randn(0, 4),
        "s": torch.tensor(3.5),
    }
    ucp_dcp.save(saved, tmp_path)
    back = {k: torch.zeros_like(v) for k, v in saved.items()}
    stats = _load(back, tmp_path)
    for k in saved:
        assert torch.equal(back[k], saved[k]), k
    assert stats.staged_bytes == sum(v.nbytes for v in saved.values())
    assert 1 <= stats.staging_buffers <= staging.BUFFERS_PER_THREAD * 2  # bounded, whatever the size


def test_staged_load_converts_dtypes_and_fills_noncontiguous_targets(tmp_path, small_buffers):
    g = torch.Generator().manual_seed(1)
    saved = {"h": torch.randn(64, 40, generator=g).to(torch.float16), "t": torch.randn(50, 30, generator=g)}
    ucp_dcp.save(saved, tmp_path)
    back = {"h": torch.zeros(64, 40, dtype=torch.float32), "t": torch.zeros(30, 50).t()}  # widen; a transposed view
    assert not back["t"].is_contiguous()
    _load(back, tmp_path)
    assert torch.equal(back["h"], saved["h"].float())
    assert torch.equal(back["t"], saved["t"])


def test_staged_narrowing_conversion_still_range_checked(tmp_path, small_buffers):
    ucp_dcp.save({"x": torch.full((40, 40), 1e6)}, tmp_path)
    err = expect_ucp_error(
        lambda: _load({"x": torch.zeros(40, 40, dtype=torch.float16)}, tmp_path), DtypeConversionError
    )
    assert err.atom == "x"


def test_staged_load_verifies_checksums(tmp_path, small_buffers):
    ucp_dcp.save({"w": torch.randn(200, 50)}, tmp_path)
    data = max(tmp_path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    err = expect_ucp_error(lambda: _load({"w": torch.zeros(200, 50)}, tmp_path), ChecksumError)
    assert err.atom == "w"


def test_staged_save_pipeline_round_trips(tmp_path):
    g = torch.Generator().manual_seed(2)
    saved = {f"p{i}": torch.randn(30 + i, 7, generator=g) for i in range(6)}
    dcp.save(saved, storage_writer=UCPFileSystemWriter(tmp_path, staging="always"), planner=UCPSavePlanner())
    assert_written_by_ucp(tmp_path)  # staged bytes verified against the sidecar's checksums
    back = {k: torch.zeros_like(v) for k, v in saved.items()}
    ucp_dcp.load(back, tmp_path)
    assert all(torch.equal(back[k], saved[k]) for k in saved)


# -- several ranks: resharding and read-once through staging, on the default group or a side group --


def _logical(shape, salt):
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).mul_(0.5).add_(salt)


def _reshard_worker(rank, world, root, side):
    import os

    from ucp_dcp.planning import collectives

    before = dict(collectives._SIDE)
    saved_env, saved_bytes = os.environ.get("UCP_DCP_P2P"), device.STAGE_BYTES
    if side:
        os.environ["UCP_DCP_P2P"] = "side"
    device.STAGE_BYTES = 4096  # many sub-items, partial buffers (restored below: workers are reused)
    try:
        return _reshard(rank, world, root, collectives, before)
    finally:
        device.STAGE_BYTES = saved_bytes
        if saved_env is None:
            os.environ.pop("UCP_DCP_P2P", None)
        else:
            os.environ["UCP_DCP_P2P"] = saved_env


def _reshard(rank, world, root, collectives, before):
    mesh = DeviceMesh("cpu", list(range(world)))
    shapes = {"a": (48, 20), "b": (7, 33), "c": (96,)}
    sd = {k: distribute_tensor(_logical(s, i), mesh, [Shard(0)]) for i, (k, s) in enumerate(shapes.items())}
    ucp_dcp.save(sd, root)
    # load replicated (every rank needs every byte: read-once sends pieces) and sharded on dim 1
    back = {k: distribute_tensor(torch.zeros(s), mesh, [Replicate()]) for k, s in shapes.items()}
    back["a"] = distribute_tensor(torch.zeros(shapes["a"]), mesh, [Shard(1)])
    for _ in range(2):  # twice: a side group is created once and reused
        reader = UCPFileSystemReader(root, staging="always")
        dcp.load(back, storage_reader=reader, planner=UCPLoadPlanner(read_once="ranks"))
    bad = [k for i, (k, s) in enumerate(shapes.items()) if not torch.equal(back[k].full_tensor(), _logical(s, i))]
    side_groups = len(set(collectives._SIDE) - set(before))
    return bad, reader.stats.bytes_received, reader.stats.staged_bytes, side_groups, dist.get_backend()


@pytest.mark.slow
@pytest.mark.parametrize("side", [False, True], ids=["default-group", "gloo-side-group"])
def test_staged_resharding_with_read_once(side):
    out = D.run(_reshard_worker, 4, D.tmpdir(), side)
    assert all(not bad for bad, *_ in out), out
    assert sum(r for _, r, *_ in out) > 0  # pieces travelled between ranks, into staged targets
    assert all(s > 0 for _, _, s, *_ in out)
    assert all(groups == (1 if side else 0) for *_, groups, _ in out)  # one side group, reused
