"""Property tests of the pattern fragment math (single process): fused sub-parameters in
interleaved blocks and padded dims, saved under one layout and loaded under another."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ucp_dcp.errors import PatternError
from ucp_dcp.layout.fragments import (
    ChunkIndex,
    clip_padding,
    exact_cover_problem,
    fused_block_problem,
    fused_segments,
    layout_fragments,
    split_fused,
)
from ucp_dcp.layout.index_maps import Chunk, IndexMap, check_ownership
from ucp_dcp.layout.placements import Layout, Placement


def _dtensor_local(g, mesh_shape, coord, placements):
    t = g
    for k, i, p in zip(mesh_shape, coord, placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, k, with_padding=False, contiguous=True)[0][i]
    return t


@st.composite
def layouts(draw, ndim=2):
    """Realistic FSDP x TP layouts of a 2-D weight sharded on dim 0 by TP, plus random ones."""
    dp = draw(st.integers(1, 4))
    tp = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["fsdp_tp", "tp_only", "rowwise", "random"]))
    if kind == "fsdp_tp":
        pl = [_StridedShard(0, split_factor=tp) if tp > 1 else Shard(0), Shard(0)]
    elif kind == "tp_only":
        pl = [Replicate(), Shard(0)]
    elif kind == "rowwise":
        pl = [Shard(0), Shard(1)]
    else:
        pl = [
            draw(st.sampled_from([Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2)])) for _ in range(2)
        ]
    return (dp, tp), pl


def _all_coords(mesh_shape):
    return itertools.product(*(range(k) for k in mesh_shape))


def _save(g, mesh_shape, pl, transform):
    """Simulated save: {atom: [(box, data)]} from every coordinate (replicas deduplicated)."""
    out = {}
    layout = Layout(mesh_shape, tuple(Placement.from_torch(p) for p in pl))
    for coord in _all_coords(mesh_shape):
        local = _dtensor_local(g, mesh_shape, coord, pl)
        frags, _ = transform(layout_fragments("live", tuple(g.shape), layout, coord))
        for f in frags:
            out.setdefault(f.atom, {})[f.box] = f.view(local).clone()
    return out


def _load(saved, target_g_shape, mesh_shape, pl, transform, fill=None):
    """Simulated load: each coordinate's local tensor filled from the saved boxes."""
    layout = Layout(mesh_shape, tuple(Placement.from_torch(p) for p in pl))
    idx = {a: ChunkIndex(list(boxes)) for a, boxes in saved.items()}
    locals_ = {}
    probe = torch.zeros(target_g_shape)
    for coord in _all_coords(mesh_shape):
        local = torch.full(_dtensor_local(probe, mesh_shape, coord, pl).shape, float("nan"))
        frags, fills = transform(layout_fragments("live", target_g_shape, layout, coord))
        for f in frags:
            pieces = idx[f.atom].overlaps(f.box)
            assert exact_cover_problem(f.box, [b for _, b in pieces]) is None
            region = f.view(local)
            for ci, ov in pieces:
                src_box = idx[f.atom].boxes[ci]
                src = saved[f.atom][src_box]
                s = src[tuple(slice(o - so, o - so + n) for o, so, n in zip(ov.offsets, src_box.offsets, ov.sizes))]
                region[tuple(slice(o - fo, o - fo + n) for o, fo, n in zip(ov.offsets, f.box.offsets, ov.sizes))] = s
        for b in fills:
            local[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] = fill
        locals_[coord] = local
    return locals_


def _blocked(parts, blocks, dim=0):
    """The live fused tensor: parts interleaved in `blocks` blocks along `dim`."""
    chunks = [p.chunk(blocks, dim) for p in parts]
    return torch.cat([c[b] for b in range(blocks) for c in chunks], dim)


@given(
    st.lists(st.integers(1, 3), min_size=2, max_size=3),  # part widths per block unit
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 5),
    layouts(),
    layouts(),
)
def test_fused_parts_round_trip_between_block_counts(units, save_blocks, load_blocks, cols, save_lay, load_lay):
    lcm = 4  # part sizes divisible by every block count used
    sizes = [u * lcm for u in units]
    torch.manual_seed(0)
    parts = [torch.randn(n, cols) for n in sizes]
    names = [f"p{i}" for i in range(len(parts))]

    def transform_for(blocks):
        assert fused_block_problem(sizes, blocks, sum(sizes)) is None
        segs = fused_segments(sizes, blocks)
        return lambda frags: (split_fused(frags, 0, segs, names), [])

    g_save = _blocked(parts, save_blocks)
    saved = _save(g_save, *save_lay, transform_for(save_blocks))
    # the saved pieces of every part tile it exactly once
    for name, part in zip(names, parts):
        boxes = list(saved[name])
        assert exact_cover_problem(type(boxes[0])((0, 0), tuple(part.shape)), boxes) is None
        for box, data in saved[name].items():
            assert torch.equal(
                data,
                part[box.offsets[0] : box.offsets[0] + box.sizes[0], box.offsets[1] : box.offsets[1] + box.sizes[1]],
            )
    g_load = _blocked(parts, load_blocks)
    got = _load(saved, tuple(g_load.shape), *load_lay, transform_for(load_blocks))
    for coord, local in got.items():
        assert torch.equal(local, _dtensor_local(g_load, *load_lay[:1], coord, load_lay[1]))


@given(st.integers(1, 30), st.integers(0, 12), st.integers(0, 12), st.integers(1, 4), layouts(), layouts())
def test_padding_round_trip_between_padded_sizes(logical, pad_save, pad_load, cols, save_lay, load_lay):
    torch.manual_seed(1)
    atom = torch.randn(logical, cols)
    clip = lambda frags: clip_padding([type(f)("w", f.box, f.local) for f in frags], 0, logical)
    g_save = torch.cat([atom, torch.randn(pad_save, cols)])  # saved padding is garbage: never read
    saved = _save(g_save, *save_lay, clip)
    assert exact_cover_problem(type(next(iter(saved["w"])))((0, 0), (logical, cols)), list(saved["w"])) is None
    g_load = torch.cat([atom, torch.full((pad_load, cols), -7.0)])
    got = _load(saved, tuple(g_load.shape), *load_lay, clip, fill=-7.0)
    for coord, local in got.items():
        assert torch.equal(local, _dtensor_local(g_load, *load_lay[:1], coord, load_lay[1]))


def test_fused_block_problems_name_the_numbers():
    assert "not all divisible by 4" in fused_block_problem([32, 6, 6], 4, 44)
    assert "sum to 44 but the live dim has 40" in fused_block_problem([32, 6, 6], 2, 40)
    assert fused_block_problem([32, 8, 8], 4, 48) is None


@given(st.integers(1, 12), st.integers(1, 4))
def test_stage_maps_cover_layers_exactly_once(n_layers, pp):
    splits = [len(c) for c in torch.arange(n_layers).tensor_split(pp)]
    claims = []
    start = 0
    for stage, n in enumerate(splits):
        m = IndexMap("layers", (Chunk(start, (), stage),), n_layers)
        for local in range(n):
            path, g = m.rewrite(("model", f"layers.{local}.w"))
            assert path == ("model", f"layers.{start + local}.w")
            claims.append((g, stage))
        start += n
    check_ownership("layers", n_layers, claims, "")
    with pytest.raises(PatternError, match="owned by no rank"):
        check_ownership("layers", n_layers + 1, claims, "")
    if n_layers > 1:
        with pytest.raises(PatternError, match="claimed by owners"):
            check_ownership("layers", n_layers, claims + [(0, 99)], "")


def test_index_map_chunks_drop_their_namespace():
    m = IndexMap("layers", (Chunk((0, 1), ("model.c0", "optim.c0"), 0), Chunk((4, 5), ("model.c1", "optim.c1"), 2)))
    assert m.rewrite(("model", "c1", "layers.1.attn.wq.weight"))[0] == ("model", "layers.5.attn.wq.weight")
    assert m.rewrite(("optim", "c0", "state", "layers.1.w", "exp_avg"))[0] == (
        "optim",
        "state",
        "layers.1.w",
        "exp_avg",
    )
    assert m.rewrite(("optim", "c1", "state.layers.0.w.exp_avg"))[0] == ("optim", "state.layers.4.w.exp_avg")
    assert m.rewrite(("model", "c1", "layers", "0", "w"))[0] == ("model", "layers", "4", "w")
    with pytest.raises(PatternError, match="no entry"):
        m.rewrite(("model", "c1", "layers.7.w"))
