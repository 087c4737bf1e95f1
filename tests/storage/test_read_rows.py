"""Read-once keys as rows of numbers: two read items need the same saved bytes exactly when their rows are
equal (what ``read_key`` tells apart), ids over all ranks' rows are exact, and a summary travels packed."""

import pickle

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ucp_dcp.storage.format import read_key
from ucp_dcp.storage.transport import ReadSummary, local_summary, piece_ids, plan_transport, read_rows

NAMES = ["b.w", "a.w", "c.obj", "d.v"]


def _metadata() -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    sd = {
        "b.w": TensorStorageMetadata(
            props, torch.Size((8, 6)), [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((8, 6)))]
        ),
        "a.w": TensorStorageMetadata(
            props, torch.Size((8, 6)), [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((8, 6)))]
        ),
        "c.obj": BytesStorageMetadata(),
        "d.v": TensorStorageMetadata(
            props, torch.Size((5,)), [ChunkStorageMetadata(torch.Size((0,)), torch.Size((5,)))]
        ),
    }
    return Metadata(state_dict_metadata=sd)


_ints = st.integers(0, 3)


@st.composite
def _item(draw) -> ReadItem:
    name = draw(st.sampled_from(NAMES))
    if name == "c.obj":
        z = torch.Size((0,))
        return ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), z, MetadataIndex(name), z, z)
    nd = 2 if name.endswith(".w") else 1
    off = draw(st.none() | st.lists(_ints, min_size=nd, max_size=nd))
    so, ln = (draw(st.lists(_ints, min_size=nd, max_size=nd)) for _ in range(2))
    idx = MetadataIndex(name, None if off is None else torch.Size(off))
    return ReadItem(LoadItemType.TENSOR, MetadataIndex("x"), torch.Size(so), idx, torch.Size(so), torch.Size(ln))


@given(st.lists(_item(), min_size=1, max_size=12))
def test_rows_are_equal_exactly_when_the_read_keys_are(items):
    md = _metadata()
    rows, _ = read_rows(items, md)
    for i, a in enumerate(items):
        for j, b in enumerate(items):
            assert (read_key(a) == read_key(b)) == bool((rows[i] == rows[j]).all()), (read_key(a), read_key(b))


@given(st.lists(st.lists(st.lists(st.integers(-2, 2), min_size=3, max_size=3), max_size=6), min_size=1, max_size=4))
def test_piece_ids_share_an_id_exactly_for_equal_rows(ranks):
    keys = [np.array(r, dtype=np.int64).reshape(-1, 3) for r in ranks]
    ids, counts = piece_ids(keys)
    rows = [tuple(x) for k in keys for x in k.tolist()]
    for i in range(len(rows)):
        for j in range(len(rows)):
            assert (ids[i] == ids[j]) == (rows[i] == rows[j])
    assert counts.sum() == len(rows) and all(counts[ids[i]] == rows.count(rows[i]) for i in range(len(rows)))


def test_rows_of_other_widths_are_padded_alike():
    a = np.array([[1, 0, 5, -1], [2, 1, -1, -1]], dtype=np.int64)
    b = np.array([[1, 0, 5, -1, -1, -1]], dtype=np.int64)
    ids, _ = piece_ids([a, b])
    assert ids[0] == ids[2] != ids[1]


def test_a_summary_travels_packed_and_comes_back_whole():
    md = _metadata()
    items = [
        ReadItem(
            LoadItemType.TENSOR,
            MetadataIndex("x"),
            torch.Size((0, 0)),
            MetadataIndex("a.w", torch.Size((0, 0))),
            torch.Size((i % 8, 0)),
            torch.Size((1, 6)),
        )
        for i in range(2000)
    ]
    s = local_summary(items, md, "ranks", rank=3, host="h")
    back = pickle.loads(pickle.dumps(s))
    assert (back.keys == s.keys).all() and (back.sizes == s.sizes).all() and back.names == s.names
    assert (back.rank, back.mode, back.host) == (3, "ranks", "h")
    assert len(pickle.dumps(s)) < 2000  # 2000 items: a few bytes each, not 16 + 8
    off = local_summary(items, md, "off", rank=1)
    assert pickle.loads(pickle.dumps(off)) == ReadSummary(1, "off")


def test_ranks_that_opened_other_metadata_read_for_themselves():
    md = _metadata()
    other = _metadata()
    other.state_dict_metadata["e.extra"] = BytesStorageMetadata()
    z = torch.Size((0,))
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("x"), z, MetadataIndex("c.obj"), z, z)
    same = [local_summary([item], md, "ranks", rank=r, host=f"h{r}") for r in range(2)]
    assert any(t.send for t in plan_transport(same))  # one reads, the other receives
    mixed = [
        local_summary([item], md, "ranks", rank=0, host="h0"),
        local_summary([item], other, "ranks", rank=1, host="h1"),
    ]
    assert not any(t.send or t.recv for t in plan_transport(mixed))
