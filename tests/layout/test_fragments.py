"""Property tests of the pure fragment math against DTensor's own split code."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ucp_dcp._compat import strided_shard_indices
from ucp_dcp.layout.fragments import Box, chunk_range, dim_runs, layout_fragments, local_shape
from ucp_dcp.layout.placements import Layout, Placement


def _dtensor_local(global_t, mesh_shape, coord, placements):
    """What DTensor stores on `coord`: apply each placement's own split, left to right."""
    t = global_t
    for k, i, p in zip(mesh_shape, coord, placements):
        if isinstance(p, (Shard, _StridedShard)):
            shards, _ = p._split_tensor(t, k, with_padding=False, contiguous=True)
            t = shards[i]
    return t


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(mesh_ndim))
    placements = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(d))
        else:
            placements.append(_StridedShard(d, split_factor=draw(st.integers(1, 4))))
    return shape, mesh_shape, placements


def _ucp_layout(mesh_shape, placements):
    return Layout(mesh_shape, tuple(Placement.from_torch(p) for p in placements))


@given(layouts())
def test_fragments_tile_local_and_global(case):
    shape, mesh_shape, placements = case
    layout = _ucp_layout(mesh_shape, placements)
    numel = math.prod(shape)
    g = torch.arange(numel, dtype=torch.int64).reshape(shape)
    covered = torch.zeros(numel, dtype=torch.int64)
    replicate_dims = [i for i, p in enumerate(placements) if isinstance(p, Replicate)]
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        local = _dtensor_local(g, mesh_shape, coord, placements)
        assert local_shape(shape, layout, coord) == tuple(local.shape)
        frags = layout_fragments("a", shape, layout, coord)
        seen = torch.zeros(local.numel(), dtype=torch.int64)
        lidx = torch.arange(local.numel()).reshape(local.shape)
        for f in frags:
            assert f.box.sizes == f.local.sizes and f.box.volume > 0
            # the local piece holds exactly the global box's values
            glob = g[tuple(slice(o, o + s) for o, s in zip(f.box.offsets, f.box.sizes))]
            assert torch.equal(f.view(local), glob)
            seen[f.view(lidx).reshape(-1)] += 1
        assert torch.all(seen == 1), "fragments must tile the local tensor exactly"
        if all(coord[d] == 0 for d in replicate_dims):
            for f in frags:
                covered[f.view(local).reshape(-1)] += 1
        # agree with DTensor's own offset helper wherever the local indices are contiguous
        dt_shape, dt_off = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert tuple(dt_shape) == tuple(local.shape)
        if len(frags) == 1:
            assert tuple(dt_off) == frags[0].box.offsets
    assert torch.all(covered == 1), "one replica's fragments must tile the global tensor exactly"


@given(st.integers(0, 40), st.integers(1, 8))
def test_chunk_range_matches_shard_helper(n, k):
    for i in range(k):
        size, off = Shard.local_shard_size_and_offset(n, k, i)
        assert chunk_range(n, k, i) == (off, size)


@given(st.integers(0, 30), st.integers(1, 5), st.integers(1, 5))
def test_strided_runs_match_strided_shard_helper(n, k, sf):
    p = _StridedShard(0, split_factor=sf)
    layout = Layout((k,), (Placement.from_torch(p),))
    for i in range(k):
        offsets = strided_shard_indices(p, n, k, i)  # torch's helper (its signature differs on 2.11)
        runs = dim_runs((n,), layout, (i,))[0]
        got = [g + j for g, m in runs for j in range(m)]
        assert got == offsets


def test_noncontiguous_layout_gets_two_boxes():
    # rank (0, 0) of [Shard(0), _StridedShard(0, sf=2)] on 8 rows holds rows {0, 2}
    layout = Layout((2, 2), (Placement("S", 0), Placement("SS", 0, 2)))
    frags = layout_fragments("w", (8, 3), layout, (0, 0))
    assert [f.box for f in frags] == [Box((0, 0), (1, 3)), Box((2, 0), (1, 3))]
    assert [f.local for f in frags] == [Box((0, 0), (1, 3)), Box((1, 0), (1, 3))]


def test_empty_shard_has_no_fragments():
    layout = Layout((4,), (Placement("S", 0),))
    assert layout_fragments("w", (5, 2), layout, (3,)) == []
    assert [f.box.sizes for f in layout_fragments("w", (5, 2), layout, (2,))] == [(1, 2)]


@pytest.mark.parametrize("code", ["R", "S(0)", "SS(1,3)", "P(sum)"])
def test_placement_codes_round_trip(code):
    assert Placement.decode(code).encode() == code
