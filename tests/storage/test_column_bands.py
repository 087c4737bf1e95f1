"""Column bands (``ucp_dcp/storage/tiles.py``, column bands): the writer cuts 2-D+ chunks along dim 1 into band chunks on
object stores, so a column slice is whole, consecutive records. The choice and the cut as pure math; the layout
as written (stock DCP still reads it; a local folder keeps whole chunks by default); the replica comparison
band by band on 2 gloo ranks. The store loads (bytes and requests at the server) are in test_object_store_dist."""

from __future__ import annotations

import math
import os

import dist as D
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

from ucp_dcp import UCPFileSystemReader, UCPFileSystemWriter, UCPLoadPlanner, UCPSavePlanner, first_ucp_error
from ucp_dcp.errors import ReplicaMismatchError, UCPError
from ucp_dcp.storage.tiles import BAND_BYTES, MAX_BAND_CHUNKS, MIN_RUN, band_boxes, band_chunks, column_bands

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_shapes = st.lists(st.integers(1, 4096), min_size=2, max_size=3)


@given(_shapes, st.sampled_from([1, 2, 4]))
def test_the_band_count_divides_dim_1_and_keeps_bands_worth_a_request(sizes, itemsize):
    b = column_bands(sizes, itemsize)
    assert b in (1, 2, 4, 8) and b <= MAX_BAND_CHUNKS and sizes[1] % b == 0
    if b > 1:
        assert math.prod(sizes) * itemsize // b >= BAND_BYTES
        assert sizes[1] // b * math.prod(sizes[2:]) * itemsize >= MIN_RUN
    if b < MAX_BAND_CHUNKS:  # no larger power of two would do
        more = 2 * b
        nbytes, inner = math.prod(sizes) * itemsize, math.prod(sizes[2:]) * itemsize
        assert sizes[1] % more or nbytes // more < BAND_BYTES or sizes[1] // more * inner < MIN_RUN


@given(_shapes, st.lists(st.integers(0, 10_000), min_size=3, max_size=3), st.sampled_from([2, 4, 8]))
def test_band_boxes_tile_the_chunk_in_dim_1_order(sizes, offsets, bands):
    sizes = [sizes[0], sizes[1] * bands, *sizes[2:]]
    offsets = offsets[: len(sizes)]
    boxes = band_boxes(offsets, sizes, bands)
    assert len(boxes) == bands
    col = offsets[1]
    for offs, size in boxes:
        assert [offs[0], *offs[2:]] == [offsets[0], *offsets[2:]] and [size[0], *size[2:]] == [sizes[0], *sizes[2:]]
        assert offs[1] == col
        col += size[1]
    assert col == offsets[1] + sizes[1]


def _md(chunks) -> Metadata:
    from torch.distributed.checkpoint.metadata import TensorProperties

    smd = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 16]), chunks)
    return Metadata({"w": smd})


def test_cutting_the_metadata_twice_cuts_once():
    """A cached save plan hands the writer the metadata it cut last time: its first band starts where the
    chunk did, and must not be cut again."""
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 16])),
        ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 16])),
    ]
    md = _md(chunks)
    cut = {("w", (0, 0)): ((4, 16), 4), ("w", (4, 0)): ((4, 16), 4)}
    band_chunks(md, cut)
    once = [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks]
    band_chunks(md, cut)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks] == once
    assert len(once) == 8 and once[1] == ((0, 4), (4, 4))


def _save(path, sd, **kw):
    dcp.save(sd, storage_writer=UCPFileSystemWriter(path, **kw), planner=UCPSavePlanner(), no_dist=True)


def _chunks(reader, key="w"):
    return [(tuple(c.offsets), tuple(c.sizes)) for c in reader.read_metadata().state_dict_metadata[key].chunks]


def test_bands_are_plain_dcp_chunks_stock_dcp_reads_bitwise(tmp_path):
    w = torch.randn(512, 2048)  # 4 MiB: 4 bands of 1 MiB
    _save(str(tmp_path), {"w": w, "b": torch.arange(4.0)}, column_bands="always")
    assert _chunks(FileSystemReader(str(tmp_path))) == [((0, k * 512), (512, 512)) for k in range(4)]
    got = {"w": torch.zeros(512, 2048), "b": torch.zeros(4)}
    dcp.load(got, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(got["w"], w) and torch.equal(got["b"], torch.arange(4.0))
    got = {"w": torch.zeros(512, 2048), "b": torch.zeros(4)}
    dcp.load(got, storage_reader=UCPFileSystemReader(str(tmp_path)), planner=UCPLoadPlanner(), no_dist=True)
    assert torch.equal(got["w"], w)


def test_a_local_folder_keeps_whole_chunks_and_a_store_gets_bands(tmp_path):
    w = torch.randn(512, 2048)
    _save(str(tmp_path), {"w": w})
    assert _chunks(FileSystemReader(str(tmp_path))) == [((0, 0), (512, 2048))]
    url = f"memory://bands-{os.getpid()}"
    _save(url, {"w": w})
    reader = UCPFileSystemReader(url)
    assert len(_chunks(reader)) == 4
    got = {"w": torch.zeros(512, 2048)}
    dcp.load(got, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert torch.equal(got["w"], w)


def test_an_unknown_band_mode_is_refused(tmp_path):
    with pytest.raises(UCPError, match="column_bands"):
        UCPFileSystemWriter(str(tmp_path), column_bands="rows")  # type: ignore[arg-type]


def _replica_worker(rank, world, root, drift):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(world))
    rep = distribute_tensor(torch.ones(1024, 512), mesh, [Replicate()], src_data_rank=None)  # 2 MiB: 2 bands
    if drift and rank == 1:
        rep.to_local()[-1, -1] += 1  # in the second band only
    writer = UCPFileSystemWriter(os.path.join(root, "ckpt"), column_bands="always")
    try:
        dcp.save({"rep": rep}, storage_writer=writer, planner=UCPSavePlanner(replica_digests="writer"))
    except CheckpointException as e:  # DCP's (a BaseException); the cause is the UCPError
        err = first_ucp_error(e)
        named = rank != 0 or "rep@[0, 256]" in str(err)  # the coordinator names the band; a peer names rank 0
        return "mismatch" if isinstance(err, ReplicaMismatchError) and named else repr(err)
    return "saved"


@pytest.mark.slow
def test_a_drifted_replica_is_caught_band_by_band():
    """The writer compares the copies of a replicated piece another rank writes: written as column bands, the
    copy is hashed band by band, so a difference in the last band is still caught before the commit."""
    out = D.run(_replica_worker, 2, D.tmpdir(), True)
    assert out == ["mismatch"] * 2, out  # named by the band that differs (a peer's error is a subclass)
    assert D.run(_replica_worker, 2, D.tmpdir(), False) == ["saved"] * 2
